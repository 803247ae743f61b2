package outbox

import "strings"

// eventColumns are the columns an event is written with, in the order of
// [Enqueue]'s unnest arrays and of [EventSelect].
const eventColumns = `event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers`

// EventSelect names, for [InsertEventsSQL], the SQL expression of each
// column of an event, over the rows of the query that produces them.
// Payload is json (a jsonb expression needs to_json, which prints it
// without parsing the text again as ::json does), Headers jsonb.
type EventSelect struct {
	EventID, Topic, AggregateType, AggregateID, AggregateVersion, EventType, Payload, Headers string
}

// InsertEventsSQL is the statement that writes one outbox event per row of
// from (the rest of a SELECT after its list: "up WHERE ..."), with each
// column's expression from sel, the way [Enqueue] writes them: an event
// whose ID is already in the outbox for its aggregate is skipped. It is
// meant for writers that produce their events inside the statement that
// makes the change (package batch writes them as a CTE step of the chunk's
// upsert) instead of sending them back through [Enqueue]. The expressions
// are the caller's SQL: build them from constants and placeholders, never
// from input.
func InsertEventsSQL(sel EventSelect, from string) string {
	return InsertNewEventsSQL(sel, from) + "\nON CONFLICT DO NOTHING"
}

// InsertNewEventsSQL is [InsertEventsSQL] for events the writer expects to
// be new: it skips the per-row check for an existing ID (a speculative
// insertion, about a sixth of the cost of writing a 500-byte event), so an event
// whose ID is already in the outbox for its aggregate fails the statement
// with a unique violation (SQLSTATE 23505). Roll back and write them with
// [InsertEventsSQL] then.
func InsertNewEventsSQL(sel EventSelect, from string) string {
	exprs := []string{sel.EventID, sel.Topic, sel.AggregateType, sel.AggregateID, sel.AggregateVersion, sel.EventType, sel.Payload, sel.Headers}
	return "INSERT INTO outbox_events (" + eventColumns + ")\nSELECT " + strings.Join(exprs, ", ") + "\nFROM " + from
}
