package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/reconcile"
)

// conflictIfUnsafe maps a refused move (and an unknown job) to exit 3.
func conflictIfUnsafe(err error) error {
	if errors.Is(err, reconcile.ErrUnknownJob) {
		return &cli.ExitError{Code: cli.ExitConflict, Err: fmt.Errorf("%w: run it once with batcher run --spec", err)}
	}
	if errors.Is(err, index.ErrUnsafeMove) {
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
			var allowUnversioned, force bool
			var healthTimeout time.Duration
			fs := cli.NewFlagSet("indexer cutover", "Checks that the job's latest run at its current processor version succeeded in every partition,\n"+
				"that every normalized row of its source carries that version, and that the version's index\n"+
				"generation matches normalized_records exactly (reconcile, processor version included), and, when\n"+
				"rows of the source table changed after the rebuild run read them, that a run followed it (the\n"+
				"catch-up; changes after that are counted as in flight); then moves\n"+
				"the read alias and the write alias to that generation in one _aliases call. The old generation is\n"+
				"kept for indexer rollback. Refused with exit 3, naming what is missing, and when the live generation\n"+
				"holds documents without a processor version (application events) that the new one lacks.\n"+
				"Several jobs may write one alias: the move changes what searches find of this job only (the read\n"+
				"alias filters each generation to the jobs' aggregate types live there); the write alias moves\n"+
				"when every job of the alias is live in the new generation. Before the move it waits for the\n"+
				"generation's health (green when the generation it replaces is green).")
			s.common.RegisterDatabase(fs)
			s.registerEngine(fs)
			s.common.RegisterLogging(fs)
			fs.String(&job, "job", "JOB", "", "scan job whose generation goes live (required)")
			fs.Duration(&wait, "wait", "", 0, "wait up to this long for the generation to be ready, printing progress (0 = check once)")
			fs.String(&s.routes, "routes", "ROUTES", "", `as for indexer run: the job's aggregate type picks the alias that moves`)
			fs.Bool(&allowUnversioned, "allow-unversioned", "", false, "cut over even though the live generation's documents without a processor version (application events) are not in the new one: searches stop finding them")
			fs.Bool(&force, "force", "", false, "move even though the checks refuse (logged, and audited in checkpoint_audit)")
			fs.Duration(&healthTimeout, "health-timeout", "", index.DefaultHealthTimeout, "wait up to this long for the generation's shards to be allocated")
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
			res, err := reconcile.Cutover(ctx, s.cfg, reconcile.CutoverOptions{DB: pool, Job: job, Wait: wait, Progress: stdout,
				AllowUnversioned: allowUnversioned, Force: force, HealthTimeout: healthTimeout, Logger: s.cfg.Logger})
			if err != nil {
				return conflictIfUnsafe(err)
			}
			printMove(stdout, res.Alias, res)
			return nil
		},
	}
}

// printMove prints what a cutover or rollback did.
func printMove(w io.Writer, alias string, res reconcile.CutoverResult) {
	if res.Already {
		fmt.Fprintf(w, "alias %s already reads job %s from %s (processor version %s)\n", alias, res.Job, res.Index, res.ProcessorVersion)
		return
	}
	forced := ""
	if res.Forced {
		forced = " (forced past: " + strings.Join(res.Missing, "; ") + ")"
	}
	scope := "job " + res.Job
	if res.Whole {
		scope += " and the write alias"
	}
	fmt.Fprintf(w, "alias %s now reads %s from %s (processor version %s, %d documents; was %v)%s\n", alias, scope, res.Index, res.ProcessorVersion, res.IndexDocs, res.From, forced)
}

func rollbackCommand(stdout io.Writer) cli.Command {
	return cli.Command{
		Name:    "rollback",
		Summary: "move a job's documents back to the generation they left at its last cutover",
		Run: func(ctx context.Context, args []string) error {
			var s settings
			var job string
			var wait, healthTimeout time.Duration
			var allowUnversioned, force bool
			fs := cli.NewFlagSet("indexer rollback", "Moves the job's documents, in one _aliases call, back to the generation the live one replaced\n"+
				"(recorded at the cutover); other jobs of the alias are not touched. Rolling back twice rolls\n"+
				"forward again. Runs the checks of indexer cutover at that generation's processor version (after\n"+
				"a cutover, run the job at the old version first) and waits for its health; refused with exit 3\n"+
				"when they fail (--force moves anyway, logged and audited), when there is no previous generation,\n"+
				"or it was dropped.")
			s.common.RegisterDatabase(fs)
			s.registerEngine(fs)
			s.common.RegisterLogging(fs)
			fs.String(&job, "job", "JOB", "", "scan job whose documents move back (required)")
			fs.Duration(&wait, "wait", "", 0, "wait up to this long for the generation to be ready, printing progress (0 = check once)")
			fs.String(&s.routes, "routes", "ROUTES", "", `as for indexer run: the job's aggregate type picks the alias`)
			fs.Bool(&allowUnversioned, "allow-unversioned", "", false, "roll back even though documents without a processor version (application events) in the generation left are not in the target: searches stop finding them")
			fs.Bool(&force, "force", "", false, "move even though the checks refuse (logged, and audited in checkpoint_audit)")
			fs.Duration(&healthTimeout, "health-timeout", "", index.DefaultHealthTimeout, "wait up to this long for the generation's shards to be allocated")
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			if job == "" {
				return cli.UsageError("--job is required")
			}
			s.noKafka = true
			if _, err := s.load(ctx, true); err != nil {
				return err
			}
			pool, err := s.common.OpenDB(ctx, 4)
			if err != nil {
				return err
			}
			defer pool.Close()
			res, err := reconcile.Rollback(ctx, s.cfg, reconcile.CutoverOptions{DB: pool, Job: job, Wait: wait, Progress: stdout,
				AllowUnversioned: allowUnversioned, Force: force, HealthTimeout: healthTimeout, Logger: s.cfg.Logger})
			if err != nil {
				return conflictIfUnsafe(err)
			}
			printMove(stdout, res.Alias, res)
			return nil
		},
	}
}

func dropCommand(stdout io.Writer) cli.Command {
	return cli.Command{
		Name:    "generations drop",
		Summary: "delete an old index generation (never the live one)",
		Run: func(ctx context.Context, args []string) error {
			var s settings
			var gen string
			fs := cli.NewFlagSet("indexer generations drop", "Deletes a generation index of the alias that neither the read alias nor the write alias points\n"+
				"at. A rollback to it is impossible afterwards. Refused with exit 3 for the live generation and for\n"+
				"an index the indexer did not create as a generation of the alias.")
			s.registerEngine(fs)
			s.common.RegisterLogging(fs)
			fs.String(&gen, "index", "", "", "the generation index to delete, e.g. records_v1 (required)")
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			if gen == "" {
				return cli.UsageError("--index is required")
			}
			s.noKafka = true
			if _, err := s.load(ctx, true); err != nil {
				return err
			}
			cfg := s.cfg.WithDefaults()
			client, err := index.NewClientWith(cfg.URL, cfg.HTTPClient)
			if err != nil {
				return err
			}
			if err := index.Drop(ctx, client, cfg.Alias, cfg.WriteAlias, gen); err != nil {
				return conflictIfUnsafe(err)
			}
			fmt.Fprintf(stdout, "dropped %s\n", gen)
			return nil
		},
	}
}
