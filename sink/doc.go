// Package sink is the indexer: it consumes the outbox topic in a Kafka
// consumer group and writes every record into Elasticsearch/OpenSearch with
// _id = the aggregate id and version = the aggregate (source) version,
// version_type=external, so that replays, stale messages and deletes are
// harmless (DESIGN.md invariants 5, 6 and 8).
//
//	ix, err := sink.New(sink.Config{
//		Brokers: []string{"127.0.0.1:9092"},
//		URL:     "http://127.0.0.1:9200",
//	})
//	if err != nil { ... }
//	err = ix.Run(ctx) // until ctx ends
//
// # Consuming and committing
//
// The indexer joins the group with kafka-go's
// [github.com/segmentio/kafka-go.ConsumerGroup] and, for every generation,
// runs a fetcher for the assigned partitions (from the committed offsets,
// never auto-committing) and one commit loop, both bound to the
// generation. The fetcher is a franz-go client
// ([github.com/twmb/franz-go/pkg/kgo]) reading read_committed: other
// producers may write into the topic in transactions, and kafka-go, asked
// for read_committed, still hands over their aborted records and the
// transaction markers as messages. The fetcher feeds a backlog kept per
// partition, and Config.Lanes lanes take batches from it, bounded by
// count, bytes and time, so at most Lanes bulk requests are in flight. A partition is in at
// most one batch at a time: its next batch is taken only once the previous
// one is resolved, so its messages are applied in offset order, while a
// free lane serves any other partition (the longest-waiting first). A lane
// resolves every item of its batch and hands it to the committer, which
// commits the offsets of resolved batches in the order they were resolved
// while the lane's next bulk is already in the engine. A committed offset
// therefore always means "everything before it is indexed or
// dead-lettered".
//
// Commits are fenced by the generation. Each message remembers the
// generation that fetched it and its offset is committed with that
// generation's id, through a loop that belongs to the generation; kafka-go
// joins the next generation only after that loop (and the fetcher) have
// returned, and the coordinator refuses an older generation's commit once
// a newer one exists. So a batch fetched before a rebalance can never move
// a partition's committed offset back behind what its new owner committed
// (with kafka-go's Reader it could: it commits with the generation current
// at commit time, and the broker does not check ownership, which left the
// lag up until new messages arrived). When a generation ends, its messages
// still in the backlog are dropped and batches already taken finish
// uncommitted; the next generation's owners read them again from the
// committed offsets, a harmless replay. A partition whose old batch is
// still in flight stays busy in the backlog, so its order holds across the
// generations too. A group this member fails to join is retried within
// RetryMaxElapsed.
//
// Lanes bound the number of concurrent bulk requests independently of the
// partition count. They are not tied to partitions: when partition p
// always went to lane p mod Lanes, a bulk the engine held up stopped its
// lane's partitions, the fetching stopped behind them and the other lanes
// ran dry, which left the engine idle for a good part of the time (issue
// 6). The backlog holds up to Lanes × 4 batches; beyond that the fetcher
// waits.
//
// The topic must exist before the group is joined: kafka-go's group,
// joined on a missing topic, may stay idle once the topic appears
// (kafka-go issue 1414), which is what happens when the indexer starts
// before the first event is published. So [Indexer.Run] creates the topic
// with Config.TopicPartitions when it is missing, or waits for it (logging
// that it waits) when it may not create it, and joins only then.
//
// # Resolving a batch
//
// Per item of the bulk answer: 2xx → indexed; 409 version conflict → the
// index already holds this version or a newer one (a replay or a stale
// message) → done, counted as a conflict, not an error; 429, 5xx,
// es_rejected_execution_exception and other transient types → only those
// items are sent again, with exponential backoff and jitter
// (cenkalti/backoff/v4), bounded by Config.RetryMaxElapsed; anything else
// (mapper_parsing_exception, illegal_argument_exception, too large) →
// dead-letter topic "<topic>.dlq" with the original key, value and headers
// plus dlq_error_code, dlq_error_reason, dlq_error_status, dlq_topic,
// dlq_partition, dlq_offset, dlq_group and dlq_time → done. Messages that
// cannot be indexed at all (no key, no parsable ce_aggregateversion,
// unknown ce_type, a non-object document, an _id over [MaxIDBytes], a
// top-level field in [ReservedFields]) go to the same topic without being
// sent. A request the engine refuses as a whole with 400 (what one invalid
// action causes) or 413 is split in halves and sent again until the item
// at fault is alone, and that item is dead-lettered; a 400 that every item
// gets alone is not one item's fault and stops the indexer (so does a
// lone document's 400 that is not the engine's own error, a proxy's). If the engine cannot be reached, the whole batch waits and
// retries: its offsets are not committed, so nothing is skipped; when the
// retry budget runs out, [Indexer.Run] returns an error and a restart
// replays the batch. `indexer dead-letter replay` re-publishes dead letters
// to their topic after a fix ([ReplayDeadLetters]), on the partition the
// publisher puts the key on. The indexer creates the dead-letter topic
// with retention.ms=-1 (Config.DeadLetterRetention) and a
// max.message.bytes that takes any message it may have to dead-letter
// (Config.DeadLetterMaxBytes); the gauge indexer_dead_letter_topic_messages
// (state stored / pending) is what to alert on. A dead-letter write is
// retried within the retry budget and gives up as soon as the run ends.
//
// # Other producers' records, routing and ids
//
// A topic may carry records the pipeline did not write. Config.SkipEventTypes
// lists other event types (ce_type; "*" for all, records without ce_type
// included) and Config.AggregateTypes the aggregate types indexed: the
// rest, keyed or not, is skipped — committed, never sent,
// counted in indexer_skipped_total{reason} and Batch.Skipped — instead of
// dead-lettered as unknown_type. Config.NullValues says what a null value
// (a Kafka tombstone) that is not a delete event means, as Kafka Connect's
// behavior.on.null.values: fail (dead-letter), ignore (skip) or delete.
// A delete needs a version (external versioning is what keeps a late
// replay from resurrecting it): a null value with a ce_aggregateversion
// header is a tombstone at that version; one without (a foreign tombstone
// has no headers) is written at the version the index holds for the id
// right now, read with one _mget per batch that has any, with
// version_type=external_gte — it hides exactly what is indexed, a later
// record with a higher version shows again, and a replay of an older or
// equal version is a conflict. Its version never comes from the Kafka
// offset (see the design's "version from the source row"). With
// NullValues "delete" every document also carries [FieldPosition], the
// partition and offset it was written from: a null value replayed (after
// a crash or a rebalance) once a later record of its key on the same
// partition is indexed is a conflict, instead of hiding that record for
// good.
//
// A record goes to the read alias targetAlias returns — Config.Routes by
// aggregate type, else Config.Alias — through that alias's write alias.
// Config.IDFormat "type:id" makes the _id "<aggregate type>:<key>" where
// ids collide across types; reconcile compares normalized_records ids with
// _id and so needs the default "id".
//
// # Durable deletes
//
// An external-versioned DELETE only leaves a tombstone in the engine's
// live version map, which is dropped after index.gc_deletes (60 s by
// default) and on every node restart; a late replay of an older upsert
// would then recreate the document. So the indexer never deletes: a delete
// event indexes a tombstone document {"_deleted": true} with the delete's
// version. It is an ordinary document, so its version is kept on disk for
// good and every older upsert gets a version conflict, forever. The read
// alias (Config.Alias, "records") carries the filter
// must_not term _deleted=true, so user searches through it never see
// tombstones without writing the filter themselves; GET by id through the
// alias does return the tombstone (filters apply to searches only). The
// cost is one small document per deleted id, until [PurgeTombstones]
// removes it: a tombstone also carries _deleted_at, when it was written,
// and goes once it is older than the horizon, the oldest record that
// could still replay an older version (the topic from its earliest
// retained offset, unpublished and dead-lettered outbox rows, dead letters
// not yet replayed), minus a margin. Since the indexer never
// deletes, the engine's own delete tombstones only come from deletes made
// by hand or by reconcile's repair; the built-in mapping sets
// index.gc_deletes to 5s so that a repair re-enqueued after such a delete
// is not refused for a minute.
//
// Every document also carries _bucket and _idv (reserved field names),
// the id's bucket and a hash of id, version, deleted-ness and processor
// version, which package reconcile aggregates to compare the index with
// normalized_records without reading documents, and _pv, the processor
// version that built it (when the event says); and _aggregate_type (the
// ce_aggregatetype header), so that reconcile compares and repairs only
// its own source's documents when several producers share an index.
//
// # Index management and reindex
//
// Writes go through Config.WriteAlias ("records-write"), with
// require_alias=true so a missing alias never auto-creates an index. When
// neither alias exists, [index.Ensure] creates "<alias>_v1" from
// Config.Mapping (default: the embedded mapping.json) with both aliases in
// the same call. A read alias without its write alias is refused
// ([index.ErrWriteAliasMissing], naming both and the _aliases call that fixes
// it): after a reindex the write alias belongs on the new generation, and
// the indexer cannot tell which that is. [Reindex] rebuilds into a new index without downtime:
// move the write alias, copy the old index on the server with
// version_type=external (live writes and copies resolve by version, in
// any order), then swap the read alias in one atomic _aliases call.
//
// # Index generations
//
// The index lifecycle (engine client, generations, aliases, bulk-load
// settings, cutover, rollback, drop) is package index's; this package
// decides which generation each consumed document goes to (the router,
// generation.go), creating or adopting it through package index.
//
// A document whose event carries ce_processorversion (every batcher event)
// is written into that processor version's generation,
// [index.GenerationIndex](alias, pv) ("records_v2"), through the generation's own
// write alias ("records_v2-write"); the indexer creates it from the
// mapping, with _meta.outboxrelay naming alias and version, the first time
// it sees the version (several indexers may race; the losers find it
// created), and trusts it for 30 s at a time. Events without a processor
// version go to the write alias. The read alias finds each job's documents
// in the generation the job is live in; a job's documents move only by
// package reconcile's Cutover (indexer cutover, or AUTO_CUTOVER in indexer
// run: once the job's run at that version succeeded, every normalized row
// carries it, the generation reconciles clean and, if rows changed behind
// the rebuild, a catch-up run followed) or Rollback, each one _aliases call
// ([index.MoveJob]). The
// external version stays the source version within each generation, so
// ordering, replays and tombstones work per generation exactly as above.
//
// Before a batch is sent, a record whose processor version is not known is
// dead-lettered (unknown_processor_version) and creates no index: known are
// Config.ProcessorVersions and the versions jobs registered
// (Config.RegisteredVersions). So is a record whose generation index exists
// but belongs to another alias or version (its _meta; two pairs can name
// one index: "orders"+"eu_v1" and "orders_eu"+"v1"), or has no _meta and is
// not the bootstrap <alias>_v1 (generation_conflict).
//
// # Throttling
//
// Config.MaxRate caps documents per second for the whole process with one
// token bucket (golang.org/x/time/rate) shared by all lanes. Independently,
// a bulk with 429 answers halves the budget (starting from the throughput
// just observed) and every clean bulk raises it by a quarter until it is
// back at the cap.
package sink
