package sink

import (
	"context"
	"fmt"
	"io"
	"sort"
	"text/tabwriter"
	"time"

	"github.com/segmentio/kafka-go"
)

// PartitionOffsets is one partition as a consumer group sees it.
type PartitionOffsets struct {
	Partition int
	First     int64 // oldest offset still in the log
	End       int64 // high watermark: the next offset to be written
	// Committed is the group's committed offset, -1 when it has none.
	Committed int64
}

// Lag is how many messages the group has not resolved yet.
func (p PartitionOffsets) Lag() int64 {
	from := p.Committed
	if from < p.First {
		from = p.First // a group without a commit starts at the earliest offset
	}
	return max(p.End-from, 0)
}

// topicOffsets returns first, end and committed offsets of every partition
// of topic for group.
func topicOffsets(ctx context.Context, c *kafka.Client, topic, group string) ([]PartitionOffsets, error) {
	ids, err := topicPartitions(ctx, c, topic)
	if err != nil {
		return nil, err
	}
	reqs := make([]kafka.OffsetRequest, 0, 2*len(ids))
	for _, id := range ids {
		reqs = append(reqs, kafka.FirstOffsetOf(id), kafka.LastOffsetOf(id))
	}
	lo, err := c.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{topic: reqs}})
	if err != nil {
		return nil, fmt.Errorf("list offsets of %s: %w", topic, err)
	}
	byID := map[int]*PartitionOffsets{}
	out := make([]PartitionOffsets, len(ids))
	for i, id := range ids {
		out[i] = PartitionOffsets{Partition: id, Committed: -1}
		byID[id] = &out[i]
	}
	for _, po := range lo.Topics[topic] {
		if po.Error != nil {
			return nil, fmt.Errorf("list offsets of %s/%d: %w", topic, po.Partition, po.Error)
		}
		if p := byID[po.Partition]; p != nil {
			p.First, p.End = po.FirstOffset, po.LastOffset
		}
	}
	of, err := c.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: ids}})
	if err != nil {
		return nil, fmt.Errorf("committed offsets of group %s: %w", group, err)
	}
	if of.Error != nil {
		return nil, fmt.Errorf("committed offsets of group %s: %w", group, of.Error)
	}
	for _, p := range of.Topics[topic] {
		if p.Error != nil {
			return nil, fmt.Errorf("committed offset of group %s on %s/%d: %w", group, topic, p.Partition, p.Error)
		}
		if q := byID[p.Partition]; q != nil {
			q.Committed = p.CommittedOffset
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Partition < out[j].Partition })
	return out, nil
}

// Status is what `indexer status` prints.
type Status struct {
	Topic, Group string
	Partitions   []PartitionOffsets
	// DeadLetterTopic holds DeadLettered messages in total, of which
	// DeadLetterPending were not re-published by `dead-letter replay` yet.
	DeadLetterTopic                 string
	DeadLettered, DeadLetterPending int64
	// ReadIndices and WriteIndices are the aliases' targets.
	ReadAlias, WriteAlias     string
	ReadIndices, WriteIndices []string
	// Generations of the read alias (engine part).
	Generations []Generation
	// RowsByPV counts normalized_records rows per processor version, the
	// target of a building generation; nil when DATABASE_URL is not set.
	RowsByPV map[string]int64
}

// TotalLag sums the lag of all partitions.
func (s *Status) TotalLag() int64 {
	var n int64
	for _, p := range s.Partitions {
		n += p.Lag()
	}
	return n
}

// GetStatus reads consumer lag per partition, the dead-letter counts and
// the aliases. The engine part is skipped when cfg.URL is empty.
func GetStatus(ctx context.Context, cfg Config) (*Status, error) {
	cfg = cfg.withDefaults()
	c := &kafka.Client{Addr: kafka.TCP(cfg.Brokers...), Timeout: 15 * time.Second}
	st := &Status{Topic: cfg.Topic, Group: cfg.Group, DeadLetterTopic: cfg.DeadLetterTopic, ReadAlias: cfg.Alias, WriteAlias: cfg.WriteAlias}
	var err error
	if st.Partitions, err = topicOffsets(ctx, c, cfg.Topic, cfg.Group); err != nil {
		return nil, err
	}
	dl, err := topicOffsets(ctx, c, cfg.DeadLetterTopic, ReplayGroup(cfg))
	if err == nil {
		for _, p := range dl {
			st.DeadLettered += p.End - p.First
			st.DeadLetterPending += p.Lag()
		}
	} else if !isUnknownTopic(err) {
		return nil, err
	}
	if cfg.URL != "" {
		client, err := NewClient(cfg.URL)
		if err != nil {
			return nil, err
		}
		if st.ReadIndices, err = AliasTargets(ctx, client, cfg.Alias); err != nil {
			return nil, err
		}
		if st.WriteIndices, err = AliasTargets(ctx, client, cfg.WriteAlias); err != nil {
			return nil, err
		}
		if st.Generations, err = Generations(ctx, client, cfg.Alias, cfg.WriteAlias); err != nil {
			return nil, err
		}
	}
	return st, nil
}

// Write prints the status as a table.
func (s *Status) Write(w io.Writer) {
	fmt.Fprintf(w, "topic %s, group %s\n", s.Topic, s.Group)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "partition\tfirst\tend\tcommitted\tlag\t")
	for _, p := range s.Partitions {
		committed := "-"
		if p.Committed >= 0 {
			committed = fmt.Sprint(p.Committed)
		}
		fmt.Fprintf(tw, "%d\t%d\t%d\t%s\t%d\t\n", p.Partition, p.First, p.End, committed, p.Lag())
	}
	tw.Flush()
	fmt.Fprintf(w, "total lag: %d\n", s.TotalLag())
	fmt.Fprintf(w, "dead-letter topic %s: %d message(s), %d not replayed\n", s.DeadLetterTopic, s.DeadLettered, s.DeadLetterPending)
	if s.ReadIndices != nil || s.WriteIndices != nil {
		fmt.Fprintf(w, "read alias %s -> %v, write alias %s -> %v\n", s.ReadAlias, s.ReadIndices, s.WriteAlias, s.WriteIndices)
	}
	if len(s.Generations) > 0 {
		s.writeGenerations(w)
	}
}

// writeGenerations prints the generations of the read alias: the live
// one, those built after it (building, with their progress against the
// normalized rows of their processor version) and the older ones kept
// for a rollback.
func (s *Status) writeGenerations(w io.Writer) {
	var live *Generation
	for i := range s.Generations {
		if s.Generations[i].Live {
			live = &s.Generations[i]
		}
	}
	fmt.Fprintf(w, "generations of %s:\n", s.ReadAlias)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "  INDEX\tPROCESSOR VERSION\tSTATE\tDOCUMENTS\tTOMBSTONES\tPROGRESS\tCREATED\tCUTOVER")
	for _, g := range s.Generations {
		state := "old (kept for rollback)"
		switch {
		case g.Live:
			state = "live"
		case live == nil || g.Meta.CreatedAt > live.Meta.CreatedAt:
			state = "building"
		}
		progress := "-"
		if rows, ok := s.RowsByPV[g.Meta.ProcessorVersion]; ok && g.Meta.ProcessorVersion != "" {
			progress = fmt.Sprintf("%d/%d normalized rows", g.Docs, rows)
			if rows > 0 {
				progress += fmt.Sprintf(" (%.1f%%)", 100*float64(min(g.Docs, rows))/float64(rows))
			}
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%d\t%d\t%s\t%s\t%s\n", g.Index, cmpOrDash(g.Meta.ProcessorVersion), state, g.Docs, g.Tombstones, progress,
			cmpOrDash(g.Meta.CreatedAt), cmpOrDash(g.Meta.CutoverAt))
	}
	tw.Flush()
}

func cmpOrDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
