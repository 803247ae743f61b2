-- 018: outbox_events refuses, at insert time, the rows the publisher or the
-- indexer would refuse later.
--
-- Applications in any language insert into outbox_events with their own SQL
-- (docs/producing-events.md). Until now a row that lacked what the pipeline
-- needs was accepted and failed only after its transaction had committed:
-- headers that are not an object of strings were dead-lettered by the
-- publisher; an empty aggregate id (no Kafka key), a negative version, or
-- an upsert without a JSON object document were dead-lettered by the
-- indexer. Each CHECK below makes the INSERT fail instead, with SQLSTATE
-- 23514 and the constraint's name in the error, in the writer's own
-- transaction. outbox.Enqueue refuses all of them first, with
-- ErrInvalidEvent. The batcher never writes such an event: a row with an
-- empty id or a negative version, or a Go processor's document that is
-- not a JSON object, is a bad row under the job's errors policy
-- (quarantined, or the run fails naming it), as before this migration.
--
-- What they cost: about 0.8 µs of PostgreSQL CPU per inserted row, most of
-- it the headers' jsonpath (a review measured the five expressions over
-- 1,000,000 rows shaped like the batcher's: 1.21 s against 0.38-0.45 s
-- for the scan alone), so under a CPU-second per 1,000,000 events. Other
-- event types than upsert keep any payload: the pipeline passes them
-- through.
--
-- NOT VALID: rows already in the outbox are not scanned (an old bad row
-- cannot block the upgrade; the publisher still dead-letters it). Adding
-- the constraints still takes an ACCESS EXCLUSIVE lock on outbox_events
-- and its partitions for a moment, after the transactions writing it end:
-- run `batcher migrate` when the writers are few, as for any migration. Every new row is checked, including the ones
-- `publisher dead-letter retry` puts back. After draining, `ALTER TABLE
-- outbox_events VALIDATE CONSTRAINT <name>` marks one validated. To undo
-- this migration: `ALTER TABLE outbox_events DROP CONSTRAINT <name>` for
-- the five names below.
ALTER TABLE outbox_events
    ADD CONSTRAINT outbox_events_topic_required CHECK (topic <> '') NOT VALID,
    ADD CONSTRAINT outbox_events_aggregate_id_required CHECK (aggregate_id <> '') NOT VALID,
    ADD CONSTRAINT outbox_events_aggregate_version_not_negative CHECK (aggregate_version >= 0) NOT VALID,
    -- json_typeof is NULL for a NULL payload: coalesce makes that a violation.
    ADD CONSTRAINT outbox_events_upsert_document
        CHECK (event_type <> 'upsert' OR coalesce(json_typeof(payload) = 'object', false)) NOT VALID,
    ADD CONSTRAINT outbox_events_headers_strings
        -- strict: lax mode would unwrap an array value and accept {"k":["v"]}.
        CHECK (jsonb_typeof(headers) = 'object' AND NOT headers @? 'strict $.* ? (@.type() != "string")') NOT VALID;
