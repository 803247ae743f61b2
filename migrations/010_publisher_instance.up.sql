-- 010: publisher instances, and NOTIFY that can be turned off.
--
-- Each running publisher process has a random instance token, renewed with
-- its heartbeat. A second process started with the same PUBLISHER_ID finds
-- the id held by another live instance and refuses to run, instead of
-- renewing the same leases and sending the same shards at once. Rows of
-- publishers from before this migration have the empty token.
ALTER TABLE outbox_publishers ADD COLUMN instance text NOT NULL DEFAULT '';
