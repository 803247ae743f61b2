// Package outbox is outboxrelay's transactional outbox: the write side
// ([Enqueue], used by the batcher and by application code in its own
// transactions) and the [Publisher] that drains outbox_events to Kafka,
// at-least-once and in order per key, with as many publishers running as you
// like.
//
// Enqueue events in the same transaction as the writes they describe:
//
//	tx, _ := pool.Begin(ctx)
//	// ... the application's own writes ...
//	_, err := outbox.Enqueue(ctx, tx, outbox.Event{
//		ID:               outbox.EventID("orders", "42", 7, "v1"),
//		Topic:            "orders",
//		AggregateType:    "order",
//		AggregateID:      "42",
//		AggregateVersion: 7,
//		Payload:          json.RawMessage(`{"status":"cancelled"}`),
//	})
//	// ... tx.Commit(ctx)
//
// and run publishers (the `publisher run` command does this):
//
//	pub, err := outbox.NewPublisher(pool, outbox.Config{Brokers: []string{"localhost:9092"}})
//	// ...
//	err = pub.Run(ctx) // until ctx is cancelled; then a soft stop
//
// # Shards and leases
//
// Every event has a shard, outboxrelay_shard(aggregate_id) in 0..63, so all
// events of one aggregate are in one shard. Each shard is a table of its
// own: outbox_events is hash-partitioned by aggregate_id into 64 partitions
// (outbox_events_shard_00 .. _63, migrations 005 and 019), and
// outboxrelay_shard is exactly PostgreSQL's choice of partition, which every
// partition's CHECK (shard = N) verifies on insert. Writers insert into
// outbox_events; a shard worker reads and deletes its own partition by name
// ([ShardTable]), so a batch touches a few hundred consecutive pages of its
// shard instead of one page per event scattered among all shards' events,
// which halves the database time per event. A publisher heartbeats into
// outbox_publishers and holds leases in outbox_shard_leases (owner, epoch,
// expiry). Every LeaseTTL/3 it renews its leases and, with L live
// publishers, aims at ceil(64/L) shards: it claims free or expired ones
// (FOR UPDATE SKIP LOCKED, epoch+1) or gives surplus ones back, but only
// after the shard's worker finished its batch in flight, so a shard is never
// sent from two healthy publishers at once. A publisher that dies loses its
// shards after LeaseTTL; one that stops cleanly releases them at once.
// Joining, giving shards back and leaving are announced on the
// outboxrelay_publishers channel, and the others rebalance at once rather
// than at their next heartbeat. A starting publisher registers and claims
// its share in its first heartbeat: the first of several started together
// takes all free shards and gives the surplus back, each one after its
// batch in flight, as soon as the others announce themselves (a join costs
// the newcomer about one batch time, and nobody waits for a join that may
// never come). Heartbeats use their own two connections so they never queue
// behind the shard work. Shard work goes through lanes of one connection
// each (Config.ShardConns, by default the pool's MaxConns), 64/ShardConns
// shard workers to a lane, so each connection prepares and plans the
// statements of a few partitions rather than all 64, and a publisher
// holding few shards uses few connections. With the LISTEN connection and
// one connection of the pool for polling and the gauges, a publisher holds
// at most ShardConns + 4 connections (see [NewPublisher]); with
// Config.NoListen it holds no session connection, for PgBouncer in
// transaction mode.
//
// # One shard, one batch at a time
//
// Each leased shard has one worker: read up to BatchSize unpublished events
// in id order (and at most BatchBytes), send them in one produce call
// with RequiredAcks=all, then delete them in one short statement fenced by
// the lease (owner and epoch). The delete names exactly the ids that were
// sent and acknowledged. The worker learns how many rows fit in BatchBytes
// and reads that many, so rows are not read twice. The delete and the read
// of the next batch go
// out as one pipelined round trip (one implicit transaction, committed
// before the next batch is sent), so a busy shard costs one query per
// batch. That transaction commits with synchronous_commit off: the broker
// already has the events, so a database crash that loses the commit only
// sends them again. No transaction or row lock is open while Kafka is
// waited on. Zero matching lease rows means the shard was lost:
// the worker stops and whatever it sent is a duplicate the new owner also
// sends, never a loss. With Config.Retention the rows move to
// outbox_published instead and are deleted in batches after the retention,
// so outbox_events holds only unpublished events either way.
//
// # One request per partition
//
// Records go to partitions with kafka.Murmur2Balancer (the Java client's
// default partitioner), so one key always lands in one partition. A batch
// never exceeds BatchSize or BatchBytes, and its share of each partition is
// sent as exactly one produce request (kafka-go's Client.Produce, acks=all),
// which the broker appends whole or not at all. After a failure, only the
// messages of the failed partitions are sent again, in their original
// order: a retry can duplicate a record but never put a key's older event
// after a newer one. The publisher retries with exponential backoff and
// jitter (backoff/v4), each attempt writing for at most WriteTimeout and
// waiting at most WriteTimeout more for its answers (see "No write after the
// lease"), each loop bounded by RetryMaxElapsed, after which the shard
// starts over from the database.
//
// # No write after the lease
//
// Every produce attempt stops writing at the shard's lease deadline, which
// is LeaseTTL/10 before the database lets another publisher claim the shard
// (the deadline counts from the start of the heartbeat that renewed the
// lease). The produce requests' context deadline is that cut plus
// WriteTimeout, kafka-go sets it on the socket, and the publisher's
// connections (cutConn) apply it to reads only and the cut to writes: no
// byte of an attempt is written after the cut, the broker's answer to what
// was written in time is waited for (giving up on it would only send the
// records again), and when the attempt returns no request of it is left
// queued to go out later. kafka.Writer is not used because it sends queued batches from
// goroutines of its own, on a context of its own, also after the call that
// queued them gave up, and Close flushes them: a publisher cut off from the
// broker could deliver an old batch after the shard's new owner sent newer
// events of the same keys (TestNoWriteAfterLeaseLost). A worker whose lease
// was lost or replaced is waited for before its shard gets a new worker in
// the same publisher, and a shard given back is released only after its
// worker finished. What remains: bytes written before the deadline that the
// network delivers after it (a request stuck in a TCP send queue longer
// than the margin plus the new owner's first write); only broker-side
// fencing (transactional producers, which kafka-go lacks) closes that.
//
// # Commit order
//
// Identity ids are handed out at insert time, not at commit, so a
// transaction that inserts id 10 and commits after id 11 was published
// leaves a gap that fills later. The publisher keeps no watermark: it
// deletes what it published, and every read takes the lowest ids still in
// the shard, so the late id 10 is simply the head of the next read.
//
// Per-key order needs no more than that. Events of one aggregate are
// written by transactions that serialise on the aggregate (the batcher's
// guarded upsert of normalized_records locks the row; an application
// updates its own row in the same transaction): the second transaction
// inserts its event only after the first one committed, so it gets the
// higher id, and any snapshot that sees the second commit sees the first.
// Reading in id order therefore follows commit order for every key.
//
// watermill-sql instead reads only rows whose pg_current_xact_id() is below
// pg_snapshot_xmin(pg_current_snapshot()), in (xact id, offset) order. That
// is not used here, on purpose: the xmin horizon is cluster-wide, so one
// idle-in-transaction session anywhere on the server would stop every
// publisher, and transaction ids order transactions by their first write,
// not their commit, which for two serialised writers of one key can be the
// wrong order. The xact_id column stays in outbox_events for diagnosis.
// Writers of one key that do not serialise have no defined order at all;
// the indexer's external versioning keeps the index right for them.
//
// # Wake-up
//
// A statement-level trigger (outbox_events_notify; [SetNotify] turns it off
// and on) NOTIFYs outboxrelay_outbox once per INSERT
// statement with the distinct shards it inserted into as the payload
// ("3,17,42", from a transition table; delivered at commit). A publisher
// LISTENs on a connection of its own and wakes those shards' workers
// directly, with no query in between. Every PollInterval, and for a
// notification it cannot read, it asks with one query which of its idle
// shards hold events (the fallback for lost notifications and while the
// LISTEN connection is down; a busy worker reads its next batch at once
// without waiting, so it needs no waking). An idle publisher costs one
// small query per PollInterval: one index probe per idle shard.
//
// NOTIFY has a cost on the writers' side: PostgreSQL takes its global
// notify lock from the commit of every transaction that notifies until the
// commit is done, so concurrent writers of the outbox commit one after
// another (16 writers committing one event each: about 2,500 events/s with
// the trigger on, 3,900 with it off on the project's 2-core test machine;
// bench/publisher, BenchmarkPublisherWriters). Where writers matter more
// than wake-up latency, turn the trigger off (`publisher notify off`) and
// poll every 100ms.
//
// # Failures
//
// Broker down or retriable errors: the batch is retried with backoff, the
// order is kept, and the Health passed in Config is degraded ("kafka") while
// any shard fails. A record the broker rejects for good (MESSAGE_TOO_LARGE,
// INVALID_RECORD, ... see [IsPermanent]; an event larger than BatchBytes is
// refused before sending) is moved to outbox_dead_letters with the error in
// the same fenced transaction, and the rest of the shard goes on. Because a
// rejected produce request does not say which record was at fault, its
// records are re-sent one at a time to find it. `publisher dead-letter
// list` shows them and `publisher dead-letter retry` re-enqueues them.
//
// Topics are never created by the publisher (no auto-creation: a typo would
// become a topic with the broker's defaults, and adding partitions later
// moves keys); create them with [EnsureTopics] (`publisher topics ensure`).
// Each topic of a batch is looked up and sent on its own, so a topic that is
// missing or forbidden (UNKNOWN_TOPIC_OR_PARTITION,
// TOPIC_AUTHORIZATION_FAILED) fails its own events only. They are retried
// for Config.TopicWait, then dead-lettered with the error; while the topic
// stays unavailable its later events are dead-lettered at once, and the
// shard's other topics are not held up. With Config.Topics set
// (PUBLISHER_TOPICS), a topic that is not on the list is treated the same
// way, whether or not the broker has it ([ErrTopicNotListed]).
//
// # Kafka record
//
// Key = aggregate id, value = payload (nil for a delete: a tombstone),
// CloudEvents binary-mode headers as described in record.go, then the
// event's own headers (traceparent, ...).
package outbox
