package outbox

import (
	"context"
	"crypto/md5"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5/pgconn"
)

// Event types the pipeline understands. Other values pass through the
// publisher unchanged.
const (
	TypeUpsert = "upsert"
	TypeDelete = "delete"
)

// Event is one row of outbox_events as an application enqueues it.
type Event struct {
	// ID is the deterministic event id (see [EventID]); it makes a replayed
	// enqueue a no-op. Required.
	ID string
	// Topic is the Kafka topic. Required.
	Topic string
	// AggregateType names the kind of entity, e.g. "source_records".
	AggregateType string
	// AggregateID is the entity id; it becomes the Kafka key and the
	// document _id. Required.
	AggregateID string
	// AggregateVersion is the entity's version at the source; it becomes the
	// external version of the document. Must be > 0.
	AggregateVersion int64
	// Type is TypeUpsert, TypeDelete or an application type. "" = upsert.
	Type string
	// Payload is the document (JSON), sent to Kafka byte for byte as given;
	// an upsert's must be a JSON object (Enqueue refuses anything else):
	// it must be what the consumers accept (the indexer's search engine
	// rejects an object with a duplicate key, for one). nil for deletes.
	Payload json.RawMessage
	// Headers are extra headers carried to Kafka, e.g. "traceparent". When
	// tracing is on and there is no "traceparent", Enqueue adds the one of
	// ctx's span.
	Headers map[string]string
}

// Querier is what Enqueue needs: a pgx.Tx, *pgx.Conn or *pgxpool.Pool.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// isObject reports whether raw (valid JSON) is an object.
func isObject(raw json.RawMessage) bool {
	for _, c := range raw {
		switch c {
		case ' ', '\t', '\n', '\r':
			continue
		}
		return c == '{'
	}
	return false
}

// ErrInvalidEvent is wrapped by Enqueue when an event lacks a required field.
var ErrInvalidEvent = errors.New("invalid outbox event")

const enqueueSQL = `
INSERT INTO outbox_events (` + eventColumns + `)
SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::bigint[], $6::text[], $7::json[], $8::jsonb[])
ON CONFLICT DO NOTHING`

// Enqueue inserts events in the caller's transaction, so they commit or roll
// back with the caller's own writes. An event whose ID is already in the
// outbox for the same aggregate is skipped (an ID names one event of one
// aggregate: the uniqueness is (event_id, aggregate_id), since outbox_events
// is partitioned by aggregate). It returns how many events were inserted.
// One statement whatever the number of events.
//
// Per-key order rule: the publisher sends a shard's events in id order, and
// ids are taken when Enqueue runs, not at commit. So two transactions that
// enqueue events of one aggregate must serialise on that aggregate before
// calling Enqueue: lock or update the aggregate's own row first (UPDATE ...,
// or SELECT ... FOR UPDATE), then Enqueue, then commit. The second
// transaction then takes its id only after the first committed, gets the
// higher id, and its event is published after the first one's. Enqueuing
// first and locking afterwards, or writing one aggregate from transactions
// that never touch a common row, leaves the order of their events
// undefined. The batcher follows the rule (its guarded upsert of
// normalized_records locks the row before its events are inserted). It also
// needs outbox_events' identity sequence at CACHE 1, which the publisher
// checks at start ([ErrIDSequenceCached]).
func Enqueue(ctx context.Context, tx Querier, events ...Event) (int64, error) {
	if len(events) == 0 {
		return 0, nil
	}
	n := len(events)
	ids, topics, types, aggIDs, evTypes := make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	versions := make([]int64, n)
	payloads, headers := make([]*string, n), make([]string, n)
	for i, e := range events {
		switch {
		case e.ID == "":
			return 0, fmt.Errorf("%w: event %d: ID is empty", ErrInvalidEvent, i)
		case e.Topic == "":
			return 0, fmt.Errorf("%w: event %s: Topic is empty", ErrInvalidEvent, e.ID)
		case e.AggregateID == "":
			return 0, fmt.Errorf("%w: event %s: AggregateID is empty", ErrInvalidEvent, e.ID)
		case e.AggregateVersion <= 0:
			return 0, fmt.Errorf("%w: event %s: AggregateVersion %d must be > 0", ErrInvalidEvent, e.ID, e.AggregateVersion)
		}
		ids[i], topics[i], types[i], aggIDs[i] = e.ID, e.Topic, e.AggregateType, e.AggregateID
		versions[i] = e.AggregateVersion
		evTypes[i] = e.Type
		if evTypes[i] == "" {
			evTypes[i] = TypeUpsert
		}
		if e.Payload != nil {
			if !json.Valid(e.Payload) {
				return 0, fmt.Errorf("%w: event %s: payload is not valid JSON", ErrInvalidEvent, e.ID)
			}
			p := string(e.Payload)
			payloads[i] = &p
		}
		// An upsert's payload is the document: a JSON object (the table's
		// outbox_events_upsert_document constraint says the same).
		if evTypes[i] == TypeUpsert && !isObject(e.Payload) {
			return 0, fmt.Errorf("%w: event %s: an upsert's payload must be a JSON object (the document); use another Type for other events", ErrInvalidEvent, e.ID)
		}
		eh := withTraceParent(ctx, e.Headers)
		h, err := json.Marshal(eh)
		if err != nil {
			return 0, fmt.Errorf("event %s: headers: %w", e.ID, err)
		}
		if eh == nil {
			h = []byte("{}")
		}
		headers[i] = string(h)
	}
	tag, err := tx.Exec(ctx, enqueueSQL, ids, topics, types, aggIDs, versions, evTypes, payloads, headers)
	if err != nil {
		return 0, fmt.Errorf("enqueue %d outbox events: %w", n, err)
	}
	return tag.RowsAffected(), nil
}

// EventID derives the deterministic event id of (source, sourceID,
// sourceVersion, processorVersion): the same inputs always give the same
// uuid. It equals the SQL function outboxrelay_event_id, so events written
// by server-side chunks and by Go code agree.
func EventID(source, sourceID string, sourceVersion int64, processorVersion string) string {
	sum := md5.Sum([]byte(source + "\x1f" + sourceID + "\x1f" + strconv.FormatInt(sourceVersion, 10) + "\x1f" + processorVersion))
	return fmt.Sprintf("%x-%x-%x-%x-%x", sum[0:4], sum[4:6], sum[6:8], sum[8:10], sum[10:16])
}
