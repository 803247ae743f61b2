package outbox

import (
	"cmp"
	"strconv"
	"strings"
)

// eventColumns are the columns an event is written with, in the order of
// [Enqueue]'s unnest arrays and of [EventSelect].
const eventColumns = `event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers`

// EventSelect names, for [InsertEventsSQL], the SQL expression of each
// column of an event, over the rows of the query that produces them.
// Payload is json (a jsonb expression needs to_json, which prints it
// without parsing the text again as ::json does), Headers jsonb.
type EventSelect struct {
	EventID, Topic, AggregateType, AggregateID, AggregateVersion, EventType, Payload, Headers string
	// PayloadBytes, for [InsertEventGroupsSQL] only, is a cheap estimate
	// of the payload's size in bytes (such as pg_column_size of the jsonb
	// it is printed from); empty means the printed payload's length, which
	// prints every payload a second time.
	PayloadBytes string
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

// GroupBytes is about how many bytes of records an event group written by
// [InsertEventGroupsSQL] carries: a statement's events of one shard are
// split into that many groups that each come to about GroupBytes (counting
// each event's payload and id and 100 bytes more), whatever the size of
// the documents, so that one group fits in a publisher's call
// (BATCH_BYTES, 1,000,000 by default).
const GroupBytes = 256 << 10

// InsertEventGroupsSQL is [InsertNewEventsSQL] writing the events as event
// groups (migration 019): the rows of from become one outbox row per shard
// (more for a statement of more than [GroupBytes] per shard). from must
// hold at most one event per aggregate: the order of a group's members is
// the plan's, not necessarily from's (ordering them would cost a sort per
// group), so two events of one aggregate could swap. Write those in
// separate statements, or with [InsertEventsSQL]. A group costs PostgreSQL one row, one
// entry in each index and one row of the NOTIFY trigger instead of one per
// event, and the publisher reads and deletes it once; it sends the events
// one by one, as if written one per row. Topic, AggregateType and Headers
// must be the same for every row of from (constants and placeholders), and
// AggregateID must be a column of from. Nothing checks the events' IDs
// against the outbox (an event written twice is sent twice); the group
// row's event_id and aggregate_id are its first event's.
func InsertEventGroupsSQL(sel EventSelect, from string) string {
	payloadBytes := cmp.Or(sel.PayloadBytes, `octet_length(`+sel.Payload+`::text)`)
	size := `(coalesce(` + payloadBytes + `, 0) + octet_length(` + sel.AggregateID + `) + 100)`
	return `INSERT INTO outbox_events (` + eventColumns + `, group_ids, group_versions, group_event_ids, group_types)
SELECT (array_agg(g_event_id))[1], ` + sel.Topic + `, ` + sel.AggregateType + `, (array_agg(g_id))[1], 0, 'group', json_agg(g_payload), ` + sel.Headers + `,
       array_agg(g_id), array_agg(g_version), array_agg(g_event_id), array_agg(g_type)
FROM (SELECT ` + sel.EventID + ` AS g_event_id, ` + sel.AggregateID + ` AS g_id, ` + sel.AggregateVersion + ` AS g_version, ` + sel.EventType + ` AS g_type, ` + sel.Payload + ` AS g_payload
      FROM ` + from + `) g
GROUP BY outboxrelay_shard(g_id), (hashtext(g_id) & 2147483647) % (SELECT 1 + coalesce(sum(` + size + `), 0) / (` + strconv.Itoa(NumShards*GroupBytes) + `) FROM ` + from + `)`
}
