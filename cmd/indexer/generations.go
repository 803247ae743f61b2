package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/reconcile"
	"github.com/outboxrelay/outboxrelay/sink"
)

// conflictIfUnsafe maps a refused move (and an unknown job) to exit 3.
func conflictIfUnsafe(err error) error {
	if errors.Is(err, reconcile.ErrUnknownJob) {
		return &cli.ExitError{Code: cli.ExitConflict, Err: fmt.Errorf("%w: run it once with batcher run --spec", err)}
	}
	if errors.Is(err, sink.ErrUnsafeMove) {
		return &cli.ExitError{Code: cli.ExitConflict, Err: err}
	}
	return usageIfConfig(err)
}

func cutoverCommand(stdout io.Writer) cli.Command {
	return cli.Command{
		Name:    "cutover",
		Summary: "make the index generation of a job's current processor version live (one alias action)",
		Run: func(ctx context.Context, args []string) error {
			var s settings
			var job string
			var wait time.Duration
			var allowUnversioned bool
			fs := cli.NewFlagSet("indexer cutover", "Checks that the job's latest run at its current processor version succeeded in every partition,\n"+
				"that every normalized row of its source carries that version, and that the version's index\n"+
				"generation matches normalized_records exactly (reconcile, processor version included), and, when\n"+
				"rows of the source table changed after the rebuild run read them, that a run followed it (the\n"+
				"catch-up; changes after that are counted as in flight); then moves\n"+
				"the read alias and the write alias to that generation in one _aliases call. The old generation is\n"+
				"kept for indexer rollback. Refused with exit 3, naming what is missing, and when the live generation\n"+
				"holds documents without a processor version (application events) that the new one lacks.")
			s.common.RegisterDatabase(fs)
			s.registerEngine(fs)
			s.common.RegisterLogging(fs)
			fs.String(&job, "job", "JOB", "", "scan job whose generation goes live (required)")
			fs.Duration(&wait, "wait", "", 0, "wait up to this long for the generation to be ready, printing progress (0 = check once)")
			fs.String(&s.routes, "routes", "ROUTES", "", `as for indexer run: the job's aggregate type picks the alias that moves`)
			fs.Bool(&allowUnversioned, "allow-unversioned", "", false, "cut over even though the live generation's documents without a processor version (application events) are not in the new one: searches stop finding them")
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			if job == "" {
				return cli.UsageError("--job is required")
			}
			s.noKafka = true // cutover does not talk to Kafka
			if _, err := s.load(ctx, true); err != nil {
				return err
			}
			pool, err := s.common.OpenDB(ctx, 4)
			if err != nil {
				return err
			}
			defer pool.Close()
			res, err := reconcile.Cutover(ctx, s.cfg, reconcile.CutoverOptions{DB: pool, Job: job, Wait: wait, Progress: stdout, AllowUnversioned: allowUnversioned})
			if err != nil {
				return conflictIfUnsafe(err)
			}
			if res.Already {
				fmt.Fprintf(stdout, "alias %s already reads %s (processor version %s)\n", s.cfg.Alias, res.Index, res.ProcessorVersion)
				return nil
			}
			fmt.Fprintf(stdout, "alias %s now reads %s (processor version %s, %d documents; was %v)\n", s.cfg.Alias, res.Index, res.ProcessorVersion, res.IndexDocs, res.From)
			return nil
		},
	}
}

func rollbackCommand(stdout io.Writer) cli.Command {
	return cli.Command{
		Name:    "rollback",
		Summary: "move the aliases back to the generation they left at the last cutover",
		Run: func(ctx context.Context, args []string) error {
			var s settings
			fs := cli.NewFlagSet("indexer rollback", "Moves the read alias and the write alias, in one _aliases call, to the generation the live\n"+
				"one replaced (recorded at the cutover). Rolling back twice rolls forward again. Refused with exit 3\n"+
				"when there is none or it was dropped.")
			s.registerEngine(fs)
			s.common.RegisterLogging(fs)
			registerLiveDatabase(fs, &s)
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			s.noKafka = true
			if _, err := s.load(ctx, true); err != nil {
				return err
			}
			from, into, err := sink.Rollback(ctx, s.cfg)
			if err != nil {
				return conflictIfUnsafe(err)
			}
			fmt.Fprintf(stdout, "alias %s now reads %s (was %s)\n", s.cfg.Alias, into, from)
			return recordRollback(ctx, stdout, &s, into)
		},
	}
}

func dropCommand(stdout io.Writer) cli.Command {
	return cli.Command{
		Name:    "generations drop",
		Summary: "delete an old index generation (never the live one)",
		Run: func(ctx context.Context, args []string) error {
			var s settings
			var index string
			fs := cli.NewFlagSet("indexer generations drop", "Deletes a generation index of the alias that neither the read alias nor the write alias points\n"+
				"at. A rollback to it is impossible afterwards. Refused with exit 3 for the live generation and for\n"+
				"an index the indexer did not create as a generation of the alias.")
			s.registerEngine(fs)
			s.common.RegisterLogging(fs)
			fs.String(&index, "index", "", "", "the generation index to delete, e.g. records_v1 (required)")
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			if index == "" {
				return cli.UsageError("--index is required")
			}
			s.noKafka = true
			if _, err := s.load(ctx, true); err != nil {
				return err
			}
			if err := sink.DropGeneration(ctx, s.cfg, index); err != nil {
				return conflictIfUnsafe(err)
			}
			fmt.Fprintf(stdout, "dropped %s\n", index)
			return nil
		},
	}
}
