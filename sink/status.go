package sink

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/outboxrelay/outboxrelay/index"
)

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
	Generations []index.Generation
	// RowsByPV counts normalized_records rows per processor version, the
	// target of a building generation; nil when DATABASE_URL is not set.
	RowsByPV map[string]int64
	// ScanByPV is the scan of the runs under way per processor version
	// (the rebuild's batcher run); nil when DATABASE_URL is not set.
	ScanByPV map[string]RunScan
}

// RunScan is how far the unfinished runs of one processor version have
// scanned, from batch_runs.
type RunScan struct {
	// Run is the run's id when there is one such run, else "".
	Run string
	// Processed rows so far; Estimated is the runs' estimated total (nil
	// when a partition has no estimate).
	Processed int64
	Estimated *int64
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
	c := &kafka.Client{Addr: kafka.TCP(cfg.Brokers...), Timeout: 15 * time.Second, Transport: cfg.kafkaTransport()}
	st := &Status{Topic: cfg.Topic, Group: cfg.Group, DeadLetterTopic: cfg.DeadLetterTopic, ReadAlias: cfg.Alias, WriteAlias: cfg.WriteAlias}
	var err error
	if st.Partitions, err = topicOffsets(ctx, c, cfg.Topic, cfg.Group); err != nil {
		return nil, err
	}
	if st.DeadLettered, st.DeadLetterPending, err = deadLetterCounts(ctx, c, cfg); err != nil {
		return nil, err
	}
	if cfg.URL != "" {
		client, err := index.NewClientWith(cfg.URL, cfg.HTTPClient)
		if err != nil {
			return nil, err
		}
		if st.ReadIndices, err = index.AliasTargets(ctx, client, cfg.Alias); err != nil {
			return nil, err
		}
		if st.WriteIndices, err = index.AliasTargets(ctx, client, cfg.WriteAlias); err != nil {
			return nil, err
		}
		if st.Generations, err = index.Generations(ctx, client, cfg.Alias, cfg.WriteAlias); err != nil {
			return nil, err
		}
	}
	return st, nil
}

// deadLetterCounts returns how many messages the dead-letter topic holds
// and how many of them `dead-letter replay` has not re-published; both 0
// when the topic does not exist yet.
func deadLetterCounts(ctx context.Context, c *kafka.Client, cfg Config) (stored, pending int64, err error) {
	dl, err := topicOffsets(ctx, c, cfg.DeadLetterTopic, ReplayGroup(cfg))
	if err != nil {
		if isUnknownTopic(err) {
			return 0, 0, nil
		}
		return 0, 0, err
	}
	for _, p := range dl {
		stored += p.End - p.First
		pending += p.Lag()
	}
	return stored, pending, nil
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
	states := generationStates(s.Generations)
	fmt.Fprintf(w, "generations of %s:\n", s.ReadAlias)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "  INDEX\tPROCESSOR VERSION\tSTATE\tDOCUMENTS\tTOMBSTONES\tPROGRESS\tCREATED\tCUTOVER")
	for i, g := range s.Generations {
		state := states[i]
		if state == stateOld {
			state = "old (kept for rollback)"
		}
		if g.Shows != "" {
			state += " (" + g.Shows + ")"
		}
		progress := "-"
		if rows, ok := s.RowsByPV[g.Meta.ProcessorVersion]; ok && g.Meta.ProcessorVersion != "" {
			progress = fmt.Sprintf("%d/%d normalized rows", g.Docs, rows)
			if rows > 0 {
				progress += fmt.Sprintf(" (%.1f%%)", 100*float64(min(g.Docs, rows))/float64(rows))
			}
		}
		if sc, ok := s.ScanByPV[g.Meta.ProcessorVersion]; ok && g.Meta.ProcessorVersion != "" {
			// The normalized rows at a version grow with the scan, so the
			// ratio above reads near 100% mid-scan: the run's own progress
			// says how far the rebuild is.
			progress += fmt.Sprintf("; scan %d", sc.Processed)
			if sc.Estimated != nil && *sc.Estimated > 0 {
				progress += fmt.Sprintf("/~%d rows (%.1f%%)", *sc.Estimated, 100*float64(min(sc.Processed, *sc.Estimated))/float64(*sc.Estimated))
			} else {
				progress += " rows"
			}
			if sc.Run != "" {
				progress += " of run " + sc.Run
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
