package sink

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/olivere/elastic/v7"
	"github.com/segmentio/kafka-go"

	"github.com/outboxrelay/outboxrelay/index"
)

// Tombstone purge.
//
// A delete is a tombstone document (see doc.go, "Durable deletes") so that
// a late replay of an older upsert gets a version conflict. Once the
// tombstone is removed, the engine accepts any version for the id again
// (after index.gc_deletes, even a real DELETE's version is forgotten), so a
// tombstone of id X at version V may go only when nothing can still deliver
// an upsert of X older than V. Everything that can:
//
//   - the topic, from each partition's earliest retained offset (a consumer
//     group may be reset, and a new generation is rebuilt from the start);
//   - outbox_events rows of the topic, not yet published;
//   - outbox_dead_letters rows of the topic (publisher dead-letter retry
//     puts them back);
//   - the dead-letter topic from the replay group's position (indexer
//     dead-letter replay re-publishes from there).
//
// Each older upsert of X was written before the delete that made the
// tombstone, and the tombstone's FieldDeletedAt is when the indexer parsed
// that delete, later still. So the horizon is the oldest time any of those
// sources holds a record from, minus a margin for clocks (the producer's
// record timestamps, PostgreSQL's, the indexer's) and for record timestamps
// within a partition that are not in offset order; a tombstone whose
// FieldDeletedAt is before it has no older upsert left anywhere.
// Tombstones written before FieldDeletedAt existed are never purged.

// HorizonSource is one place older versions may still come from, and the
// oldest time it holds a record from; Oldest is zero when it holds none.
type HorizonSource struct {
	Name   string // e.g. "topic outbox.events"
	Oldest time.Time
	Detail string // where the oldest record is, e.g. "partition 2 offset 1400"
}

// Horizon is the purge horizon: tombstones deleted before At may go.
type Horizon struct {
	At time.Time
	// BoundedBy is the source whose oldest record set At; "" when no source
	// holds any record, and At is now minus the margin.
	BoundedBy string
	Margin    time.Duration
	Sources   []HorizonSource
}

// ComputeHorizon returns the horizon for sources: the oldest record any of
// them holds minus margin, or now minus margin when none holds any.
func ComputeHorizon(now time.Time, margin time.Duration, sources []HorizonSource) Horizon {
	h := Horizon{At: now, Margin: margin, Sources: sources}
	for _, s := range sources {
		if !s.Oldest.IsZero() && s.Oldest.Before(h.At) {
			h.At, h.BoundedBy = s.Oldest, s.Name
		}
	}
	h.At = h.At.Add(-margin)
	return h
}

// Write prints the horizon and how it was computed.
func (h Horizon) Write(w io.Writer) {
	bound := h.BoundedBy
	if bound == "" {
		bound = "now (no source holds a record)"
	}
	fmt.Fprintf(w, "horizon %s (bounded by %s, margin %s)\n", h.At.UTC().Format(time.RFC3339Nano), bound, h.Margin)
	for _, s := range h.Sources {
		if s.Oldest.IsZero() {
			fmt.Fprintf(w, "  %s: nothing held\n", s.Name)
			continue
		}
		fmt.Fprintf(w, "  %s: oldest %s (%s)\n", s.Name, s.Oldest.UTC().Format(time.RFC3339Nano), s.Detail)
	}
}

// DefaultPurgeMargin is the margin PurgeOptions.Margin defaults to.
const DefaultPurgeMargin = time.Hour

// PurgeOptions says how to purge tombstones.
type PurgeOptions struct {
	// DB is the outbox database. Nil skips outbox_events and
	// outbox_dead_letters, which is only safe when no outbox writes to the
	// topic (another producer's topic).
	DB interface {
		QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	}
	Margin time.Duration // subtracted from the oldest record (≥ 0)
	DryRun bool          // count, delete nothing
	Now    func() time.Time
}

// PurgedIndex is one index's outcome.
type PurgedIndex struct {
	Index string
	// Purged is how many tombstones were deleted (DryRun: would be).
	Purged int64
	// Kept counts the tombstones not older than the horizon, Legacy those
	// without FieldDeletedAt (never purged).
	Kept, Legacy int64
}

// PurgeResult is what PurgeTombstones did.
type PurgeResult struct {
	Horizon Horizon
	Indices []PurgedIndex
}

// PurgeTombstones computes the horizon of cfg's topic and deletes, from
// every generation of every alias records may go to (Config.Alias and the
// ROUTES aliases: the indices the aliases point at and those whose _meta
// names them), the tombstones deleted before it. Only cfg's topic bounds
// the horizon: when other topics feed the same index, their tombstones
// are purged by this topic's horizon too.
//
// It deletes by query, matching only documents that are still tombstones
// (FieldDeleted true) with FieldDeletedAt before the horizon. Delete by
// query deletes a document only at the sequence number it matched: a
// tombstone re-upserted (or re-deleted) between the match and the delete is
// a version conflict, skipped, not deleted.
func PurgeTombstones(ctx context.Context, cfg Config, opts PurgeOptions) (PurgeResult, error) {
	cfg = cfg.withDefaults()
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Margin < 0 {
		return PurgeResult{}, &ConfigError{Err: fmt.Errorf("purge margin %s: want ≥ 0", opts.Margin)}
	}
	sources, err := horizonSources(ctx, cfg, opts)
	if err != nil {
		return PurgeResult{}, err
	}
	res := PurgeResult{Horizon: ComputeHorizon(opts.Now(), opts.Margin, sources)}
	client, err := index.NewClientWith(cfg.URL, cfg.HTTPClient)
	if err != nil {
		return res, err
	}
	rules := newRecordRules(cfg)
	for _, alias := range rules.aliases() {
		gens, err := index.Generations(ctx, client, alias, rules.writeAliasOf(alias))
		if err != nil {
			return res, err
		}
		for _, g := range gens {
			if g.Meta.Alias == "" && !g.Live && !g.Writes {
				continue // only named like a generation: not known to be the indexer's
			}
			pi, err := purgeIndex(ctx, client, g.Index, res.Horizon.At, opts.DryRun)
			if err != nil {
				return res, err
			}
			res.Indices = append(res.Indices, pi)
		}
	}
	return res, nil
}

func tombstonesQuery(extra ...any) map[string]any {
	return map[string]any{"bool": map[string]any{"filter": append([]any{map[string]any{"term": map[string]any{FieldDeleted: true}}}, extra...)}}
}

func purgeIndex(ctx context.Context, client *elastic.Client, idx string, horizon time.Time, dryRun bool) (PurgedIndex, error) {
	pi := PurgedIndex{Index: idx}
	before := map[string]any{"range": map[string]any{FieldDeletedAt: map[string]any{"lt": horizon.UnixMilli()}}}
	old := tombstonesQuery(before)
	// The counts and the delete by query search: tombstones written since
	// the last refresh would be neither counted nor purged.
	if err := index.Refresh(ctx, client, idx); err != nil {
		return pi, fmt.Errorf("refresh %s before counting its tombstones: %w", idx, err)
	}
	var err error
	if pi.Legacy, err = index.CountDocs(ctx, client, idx, map[string]any{"bool": map[string]any{
		"filter":   []any{map[string]any{"term": map[string]any{FieldDeleted: true}}},
		"must_not": []any{map[string]any{"exists": map[string]any{"field": FieldDeletedAt}}},
	}}); err != nil {
		return pi, err
	}
	all, err := index.CountDocs(ctx, client, idx, tombstonesQuery())
	if err != nil {
		return pi, err
	}
	if dryRun {
		if pi.Purged, err = index.CountDocs(ctx, client, idx, old); err != nil {
			return pi, err
		}
	} else {
		res, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{
			Method: http.MethodPost,
			Path:   "/" + url.PathEscape(idx) + "/_delete_by_query",
			// conflicts=proceed: a tombstone changed since it matched is
			// skipped (it is no longer the tombstone that matched).
			Params: url.Values{"conflicts": {"proceed"}, "refresh": {"true"}},
			Body:   map[string]any{"query": old},
		})
		if err != nil {
			return pi, fmt.Errorf("purge tombstones of %s: %w", idx, err)
		}
		var out struct {
			Deleted  int64 `json:"deleted"`
			Failures []json.RawMessage
		}
		if err := json.Unmarshal(res.Body, &out); err != nil {
			return pi, fmt.Errorf("decode delete by query of %s: %w", idx, err)
		}
		if len(out.Failures) > 0 {
			return pi, fmt.Errorf("purge tombstones of %s: %d failure(s), first: %s", idx, len(out.Failures), out.Failures[0])
		}
		pi.Purged = out.Deleted
	}
	pi.Kept = max(all-pi.Legacy-pi.Purged, 0)
	return pi, nil
}

// horizonSources reads the oldest record of every source of older versions.
func horizonSources(ctx context.Context, cfg Config, opts PurgeOptions) ([]HorizonSource, error) {
	c := &kafka.Client{Addr: kafka.TCP(cfg.Brokers...), Timeout: 30 * time.Second, Transport: cfg.kafkaTransport()}
	topic, err := oldestRecord(ctx, cfg, c, cfg.Topic, cfg.Group, false)
	if err != nil {
		return nil, err
	}
	topic.Name = "topic " + cfg.Topic
	dlq, err := oldestRecord(ctx, cfg, c, cfg.DeadLetterTopic, ReplayGroup(cfg), true)
	if err != nil && !isUnknownTopic(err) { // no dead letter yet: nothing held
		return nil, err
	}
	dlq.Name = "dead-letter topic " + cfg.DeadLetterTopic + " (not yet replayed)"
	out := []HorizonSource{topic, dlq}
	if opts.DB == nil {
		return out, nil
	}
	for _, table := range []string{"outbox_events", "outbox_dead_letters"} {
		s := HorizonSource{Name: table + " of topic " + cfg.Topic}
		var oldest *time.Time
		var n int64
		// No index on (topic, created_at): both tables are small while the
		// publisher keeps up.
		if err := opts.DB.QueryRow(ctx, `SELECT min(created_at), count(*) FROM `+table+` WHERE topic = $1`, cfg.Topic).Scan(&oldest, &n); err != nil {
			return nil, fmt.Errorf("oldest row of %s: %w", table, err)
		}
		if oldest != nil {
			s.Oldest, s.Detail = *oldest, strconv.FormatInt(n, 10)+" row(s)"
		}
		out = append(out, s)
	}
	return out, nil
}

// oldestRecord returns the oldest record timestamp over the first retained
// record of every partition of topic (fromCommitted: the first record group
// has not consumed).
func oldestRecord(ctx context.Context, cfg Config, c *kafka.Client, topic, group string, fromCommitted bool) (HorizonSource, error) {
	var s HorizonSource
	offs, err := topicOffsets(ctx, c, topic, group)
	if err != nil {
		return s, err
	}
	for _, po := range offs {
		from := po.First
		if fromCommitted {
			from = max(from, po.Committed)
		}
		if from >= po.End {
			continue
		}
		t, at, err := recordTime(ctx, cfg, topic, po.Partition, from)
		if err != nil {
			return s, err
		}
		if s.Oldest.IsZero() || t.Before(s.Oldest) {
			s.Oldest, s.Detail = t, fmt.Sprintf("partition %d offset %d", po.Partition, at)
		}
	}
	return s, nil
}

// recordTimeout bounds the read of one partition's first record.
const recordTimeout = 15 * time.Second

func recordTime(ctx context.Context, cfg Config, topic string, partition int, offset int64) (time.Time, int64, error) {
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: cfg.Brokers, Dialer: cfg.kafkaDialer("outboxrelay-indexer"), Topic: topic, Partition: partition, MaxWait: 250 * time.Millisecond, MaxBytes: 1 << 20})
	defer r.Close()
	if err := r.SetOffset(offset); err != nil {
		return time.Time{}, 0, err
	}
	ctx, cancel := context.WithTimeout(ctx, recordTimeout)
	defer cancel()
	m, err := r.FetchMessage(ctx)
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			err = fmt.Errorf("no record within %s (only transaction markers?): %w", recordTimeout, err)
		}
		return time.Time{}, 0, fmt.Errorf("read %s/%d at offset %d: %w", topic, partition, offset, err)
	}
	return m.Time, m.Offset, nil
}

// Write prints the result: the horizon and the tombstones per index.
func (r PurgeResult) Write(w io.Writer, dryRun bool) {
	r.Horizon.Write(w)
	verb := "purged"
	if dryRun {
		verb = "would purge"
	}
	for _, pi := range r.Indices {
		fmt.Fprintf(w, "%s: %s %d tombstone(s), kept %d newer than the horizon", pi.Index, verb, pi.Purged, pi.Kept)
		if pi.Legacy > 0 {
			fmt.Fprintf(w, " and %d without %s (written before it existed; never purged)", pi.Legacy, FieldDeletedAt)
		}
		fmt.Fprintln(w)
	}
}
