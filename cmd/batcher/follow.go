package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/cli"
)

// followFlags are `batcher run --follow` and its settings (issue 17).
type followFlags struct {
	On          bool
	Poll        time.Duration
	MinInterval time.Duration
	Listen      bool
}

func (f *followFlags) register(fs *cli.FlagSet) {
	fs.Bool(&f.On, "follow", "FOLLOW", false, "incremental jobs only: keep running, one run after another while the table changes; when idle, wait for a NOTIFY from the trigger `batcher follow-trigger` installs, or the poll interval")
	fs.Duration(&f.Poll, "follow-poll", "FOLLOW_POLL", batch.DefaultFollowPoll, "with --follow: how often an idle follower looks for changes without a NOTIFY (one max() over the change column)")
	fs.Duration(&f.MinInterval, "follow-min-interval", "FOLLOW_MIN_INTERVAL", batch.DefaultFollowMinInterval, "with --follow: the least time from one run's start to the next while the table keeps changing, so a busy table's changes go into one run (0: a run per change as fast as runs go)")
	fs.Bool(&f.Listen, "follow-listen", "FOLLOW_LISTEN", true, "with --follow: LISTEN for the trigger's NOTIFY; false behind PgBouncer in transaction mode (polling only)")
}

func (f followFlags) validate(c runConfig) error {
	switch {
	case !f.On:
		return nil
	case c.RunID != "":
		return cli.UsageError("--follow with --run-id %s: a follower starts a new run each time", c.RunID)
	case c.MaxChunks != 0:
		return cli.UsageError("--follow with MAX_CHUNKS=%d: a follower does not stop by itself", c.MaxChunks)
	case c.Partition != "":
		return cli.UsageError("--follow with --partition (BATCH_PARTITION) %s: a follower works on every partition of the job's runs (a run ends when all its partitions do); leave it unset and start several followers, which share the partitions through leases", c.Partition)
	case f.Poll <= 0:
		return cli.UsageError("FOLLOW_POLL=%s: want > 0", f.Poll)
	case f.MinInterval < 0:
		return cli.UsageError("FOLLOW_MIN_INTERVAL=%s: want >= 0", f.MinInterval)
	}
	return nil
}

// conns is the LISTEN session a follower holds beside the runs' pool.
func (f followFlags) conns() int {
	if f.On && f.Listen {
		return 1
	}
	return 0
}

func followRun(soft, hard context.Context, pool *pgxpool.Pool, spec batch.Spec, cfg batch.Config, f followFlags, logger *slog.Logger, stdout io.Writer) error {
	if mode := cmp.Or(spec.Mode, batch.ModeFull); mode != batch.ModeIncremental {
		return cli.UsageError("--follow: job %s has mode %s; only an incremental job can be followed (a full run reads every row in scope: run it on a schedule instead)", spec.Job, mode)
	}
	minInterval := f.MinInterval
	if minInterval == 0 {
		minInterval = -1 // no floor (the library's zero is its default)
	}
	fl, err := batch.NewFollower(pool, spec, cfg, batch.FollowConfig{PollInterval: f.Poll, PollOnly: !f.Listen, MinInterval: minInterval})
	if err != nil {
		return cli.UsageError("%v", err)
	}
	logger.Info("following", slog.String("job", spec.Job), slog.Duration("follow_poll", f.Poll), slog.Duration("follow_min_interval", f.MinInterval), slog.Bool("follow_listen", f.Listen))
	sum, err := fl.Run(soft, hard)
	if err != nil {
		return classify(err)
	}
	fmt.Fprintf(stdout, "job %s: stopped following after %d runs (%d chunks, %d rows, %d changed, %d quarantined by this process); last run %s\n",
		spec.Job, sum.Runs, sum.Chunks, sum.Rows, sum.Changed, sum.Quarantined, cmp.Or(sum.LastRunID, "-"))
	return nil
}

// followCommands are the follow mode's helpers.
func followCommands(stdout io.Writer) []cli.Command {
	return []cli.Command{
		{Name: "follow-trigger", Summary: "print (or --install) the NOTIFY trigger that wakes `run --follow` on table changes, and the delete capture", Run: func(ctx context.Context, args []string) error { return followTriggerCmd(ctx, args, stdout) }},
	}
}

func followTriggerCmd(ctx context.Context, args []string, stdout io.Writer) error {
	var c cli.Common
	var specFile, job string
	var install bool
	fs := cli.NewFlagSet("batcher follow-trigger", "Prints the statement-level trigger that sends a NOTIFY on channel "+batch.FollowChannel+" (payload: the\ntable) after every INSERT, UPDATE, DELETE or TRUNCATE of the job's source table, and the delete\ncapture (deleted ids, truncates and the old ids of rows whose id an UPDATE changed into batch_deletes, in the writer's transaction; read by jobs\nwith vanished: delete); on a partitioned table, on every partition too (run it again after creating\na partition: runs that drain deletes refuse to start until then); with --install it runs them\n(needs the right to create triggers on the table; the capture runs as the installing role, so\nwriters need no grant). PostgreSQL 14 or newer.")
	c.RegisterDatabase(fs)
	fs.String(&specFile, "spec", "BATCH_SPEC", "", "job spec file (.yaml, .yml or .json)")
	fs.String(&job, "job", "BATCH_JOB", "", "a job that ran before (instead of --spec; needs the database)")
	fs.Bool(&install, "install", "", false, "run the SQL instead of printing it")
	if _, err := fs.Parse(args); err != nil {
		return err
	}
	if specFile == "" && job == "" {
		return cli.UsageError("set --spec FILE (or BATCH_SPEC) or --job NAME")
	}
	if specFile != "" && !install {
		spec, err := loadSpec(ctx, nil, specFile, job)
		if err != nil {
			return err
		}
		if !spec.Document.HasRelations() {
			_, err = io.WriteString(stdout, batch.FollowTriggerSQL(spec))
			return err
		}
		// A relation's joins may come from the catalog's foreign keys.
	}
	pool, err := c.OpenDB(ctx, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	spec, err := loadSpec(ctx, pool, specFile, job)
	if err != nil {
		return err
	}
	sql, err := batch.FollowTriggerSQLFor(ctx, pool, spec)
	if err != nil {
		return err
	}
	if !install {
		_, err = io.WriteString(stdout, sql)
		return err
	}
	if _, err := pool.Exec(ctx, sql); err != nil {
		return fmt.Errorf("install the follow trigger on %s: %w", spec.Source.Table, err)
	}
	fmt.Fprintf(stdout, "follow trigger installed on %s (NOTIFY %s), with the delete capture (%s)\n", spec.Source.Table, batch.FollowChannel, batch.CaptureTrigger)
	missing, err := batch.UnindexedJoins(ctx, pool, spec)
	if err != nil {
		return err
	}
	for _, m := range missing {
		fmt.Fprintf(stdout, "warning: no index leads with join column %s\n", m)
	}
	if tables := batch.RelationTables(spec); len(tables) > 0 {
		fmt.Fprintf(stdout, "relation capture and follow triggers installed on %s; install them again after a change of the relations' tables, names or joins\n", strings.Join(tables, ", "))
	}
	return nil
}
