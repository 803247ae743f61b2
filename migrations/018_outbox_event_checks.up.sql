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
-- transaction. outbox.Enqueue already refused the first three for Go
-- callers; the batcher's events satisfy all of them.
--
-- The checks are cheap (a comparison each; the headers check walks the
-- few headers an event has). Other event types than upsert keep any
-- payload: the pipeline passes them through.
--
-- NOT VALID: rows already in the outbox are not scanned (no long lock, and
-- an old bad row cannot block the upgrade; the publisher still
-- dead-letters it). Every new row is checked, including the ones
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
        CHECK (jsonb_typeof(headers) = 'object' AND NOT headers @? '$.* ? (@.type() != "string")') NOT VALID;
