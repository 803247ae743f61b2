package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/logging"
	"github.com/outboxrelay/outboxrelay/internal/metrics"
	"github.com/outboxrelay/outboxrelay/internal/shutdown"
)

// scanCommands are the scan-job sub-commands (issue 3).
func scanCommands(stdout io.Writer) []cli.Command {
	return []cli.Command{
		{Name: "run", Summary: "run a scan job (resumes its unfinished run, or starts a new one)", Run: func(ctx context.Context, args []string) error { return runCmd(ctx, args, stdout) }},
		statusCommand(stdout),
		stateCommand(stdout, "paused"),
		stateCommand(stdout, "pending"),
		checkpointSetCommand(stdout),
		quarantineListCommand(stdout),
		quarantineRetryCommand(stdout),
	}
}

type runConfig struct {
	cli.Common
	cli.Metrics
	Spec      string
	Job       string
	RunID     string
	Partition string
	Restart   bool
	Resume    bool
	Rebuild   bool
	MaxChunks int
	Workers   int
	WorkerID  string
	LeaseTTL  time.Duration
	Grace     time.Duration
	Linger    time.Duration // METRICS_LINGER
	Progress  string
	Follow    followFlags
	// OpenWritersWait: OPEN_WRITERS_WAIT (0 = no limit).
	OpenWritersWait time.Duration
}

func (c runConfig) validate() error {
	switch {
	case c.Spec == "" && c.Job == "":
		return cli.UsageError("set --spec FILE (or BATCH_SPEC) or --job NAME (a job that ran before)")
	case c.Restart && c.Resume:
		return cli.UsageError("--restart and --resume exclude each other")
	case c.Workers < 1:
		return cli.UsageError("WORKERS=%d: want >= 1", c.Workers)
	case c.MaxChunks < 0:
		return cli.UsageError("MAX_CHUNKS=%d: want >= 0", c.MaxChunks)
	case c.LeaseTTL < 100*time.Millisecond:
		return cli.UsageError("LEASE_TTL=%s: want >= 100ms", c.LeaseTTL)
	case c.OpenWritersWait < 0:
		return cli.UsageError("OPEN_WRITERS_WAIT=%s: want >= 0 (0 = wait without limit)", c.OpenWritersWait)
	case c.Progress != "auto" && c.Progress != "on" && c.Progress != "off":
		return cli.UsageError("PROGRESS=%q: want auto, on or off", c.Progress)
	}
	return c.Follow.validate(c)
}

func runCmd(ctx context.Context, args []string, stdout io.Writer) error {
	var c runConfig
	fs := cli.NewFlagSet("batcher run", "Runs a scan job: every chunk commits normalized rows, outbox events and the checkpoint in\none transaction. SIGTERM/SIGINT stops at the next chunk boundary (exit 0); a second signal\nor the grace period cancels the chunk in flight (it rolls back).")
	c.RegisterDatabase(fs)
	c.RegisterLogging(fs)
	fs.String(&c.Spec, "spec", "BATCH_SPEC", "", "job spec file (.yaml, .yml or .json)")
	fs.String(&c.Job, "job", "BATCH_JOB", "", "run a job with the spec it last ran with (instead of --spec)")
	fs.String(&c.RunID, "run-id", "BATCH_RUN_ID", "", "logical run id (default: the job's unfinished run, else a new one)")
	fs.String(&c.Partition, "partition", "BATCH_PARTITION", "", "work on this partition only (default: all)")
	fs.Bool(&c.Restart, "restart", "", false, "start a new run from the beginning (supersedes the unfinished one)")
	fs.Bool(&c.Resume, "resume", "", false, "continue a run made by a processor version the spec declares compatible; or accept a changed document section under the same processor version (audited)")
	fs.Bool(&c.Rebuild, "rebuild", "", false, "run at a processor version that was the job's live one before and is not now (after a cutover or rollback): rebuild its index generation beside the live one; without it such a run is refused (exit 3)")
	fs.Int(&c.MaxChunks, "max-chunks", "MAX_CHUNKS", 0, "stop softly after this many chunks (0 = no limit)")
	fs.Int(&c.Workers, "workers", "WORKERS", 1, "partitions worked on at once by this process")
	fs.String(&c.WorkerID, "worker-id", "WORKER_ID", "", "name of this worker in leases (default host-pid)")
	fs.Duration(&c.LeaseTTL, "lease-ttl", "LEASE_TTL", 30*time.Second, "a lease without heartbeat for this long may be taken by another worker; a stalled worker's open chunk transaction is ended after as long (a chunk may take longer)")
	fs.Duration(&c.Grace, "grace", "SHUTDOWN_GRACE", 30*time.Second, "after the first signal, wait this long for the chunk in flight before cancelling it")
	fs.Duration(&c.OpenWritersWait, "open-writers-wait", "OPEN_WRITERS_WAIT", batch.DefaultOpenWritersWait, "how long a run start waits for transactions that had written the source table when it read its boundaries (they may still commit rows below them); past it the run does not start: a one-shot run exits 1 naming them, a follower logs it and tries again (0 = wait without limit)")
	c.RegisterMetrics(fs, "127.0.0.1:9101")
	fs.Duration(&c.Linger, "metrics-linger", "METRICS_LINGER", 0, "after the run ends, keep serving /metrics this long (or until a signal) so a last scrape sees the final numbers (0 = exit at once)")
	fs.String(&c.Progress, "progress", "PROGRESS", "auto", "progress line on stderr: auto (on a terminal), on or off")
	c.Follow.register(fs)
	if _, err := fs.Parse(args); err != nil {
		return err
	}
	if err := c.validate(); err != nil {
		return err
	}
	ep, err := c.Endpoint()
	if err != nil {
		return err
	}
	logger, err := c.Logger()
	if err != nil {
		return err
	}
	soft, hard, stop := shutdown.Contexts(ctx, c.Grace, logger)
	defer stop()
	// Each worker holds a connection per chunk in flight (chunk.pipeline,
	// at most 2 by default) plus the heartbeats and lease checks.
	pool, err := c.OpenDB(hard, 3*c.Workers+2+c.Follow.conns())
	if err != nil {
		return err
	}
	defer pool.Close()
	spec, err := loadSpec(hard, pool, c.Spec, c.Job)
	if err != nil {
		return err
	}
	reg := metrics.NewRegistry()
	health := metrics.NewHealth()
	health.AddCheck("postgres", pool.Ping)
	if err := metrics.Serve(hard, ep, reg, health, logger); err != nil {
		return cli.UsageError("%v", err)
	}
	if ep.Addr != "" && c.Linger > 0 {
		defer lingerMetrics(soft, c.Linger, logger)
	}
	cfg := batch.Config{
		StartOptions: batch.StartOptions{RunID: c.RunID, Restart: c.Restart, Resume: c.Resume, Rebuild: c.Rebuild},
		WorkerID:     c.WorkerID, Workers: c.Workers, LeaseTTL: c.LeaseTTL, MaxChunks: c.MaxChunks, Partition: c.Partition,
		Logger: logger, Metrics: batch.NewMetrics(reg, pool), OpenWritersWait: c.OpenWritersWait,
	}
	if c.OpenWritersWait == 0 {
		cfg.OpenWritersWait = -1 // no limit (the library's zero is its default)
	}
	if c.Progress == "on" || (c.Progress == "auto" && logging.IsTerminal(os.Stderr)) {
		cfg.Progress = os.Stderr
	}
	if c.Follow.On {
		return followRun(soft, hard, pool, spec, cfg, c.Follow, logger, stdout)
	}
	r, err := batch.NewRunner(pool, spec, cfg)
	if err != nil {
		return cli.UsageError("%v", err)
	}
	// Preparing may wait for the job lock or for open writers of the
	// source table; a first signal ends that wait and nothing starts.
	runID, err := r.Prepare(soft)
	if err != nil {
		if soft.Err() != nil && hard.Err() == nil {
			fmt.Fprintf(stdout, "job %s: stopped before a run was prepared; nothing changed\n", spec.Job)
			return nil
		}
		return classify(err)
	}
	logger.Info("run prepared", slog.String("job", spec.Job), slog.String("run", runID), slog.String("processor_version", spec.ProcessorVersion))
	sum, err := r.Run(soft, hard)
	if err != nil {
		return classify(err)
	}
	if sum != nil {
		state := "stopped at the last committed checkpoint"
		if sum.Done {
			state = "succeeded"
		}
		fmt.Fprintf(stdout, "job %s run %s: %s (%d chunks, %d rows, %d changed, %d quarantined by this process)\n",
			spec.Job, sum.RunID, state, sum.Chunks, sum.Rows, sum.Changed, sum.Quarantined)
	}
	return nil
}

// lingerMetrics keeps the process (and its metrics endpoint) up for d after
// the run, or until the first signal: a batcher exits when its run ends,
// and a Prometheus scraping every 15s would miss the last chunks' numbers.
func lingerMetrics(soft context.Context, d time.Duration, logger *slog.Logger) {
	logger.Info("run ended; serving metrics a while longer", slog.Duration("metrics_linger", d))
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-soft.Done():
	}
}

// openWritersSetting names Config.OpenWritersWait in the batcher's errors.
const openWritersSetting = "OPEN_WRITERS_WAIT (--open-writers-wait)"

func classify(err error) error {
	var writers *batch.OpenWritersError
	if errors.As(err, &writers) {
		return errors.New(writers.Message(openWritersSetting))
	}
	var notLive *batch.LiveVersionError
	if errors.As(err, &notLive) {
		return &cli.ExitError{Code: cli.ExitConflict, Err: errors.New(notLive.Message("--rebuild"))}
	}
	var incompatible *batch.IncompatibleError
	if errors.As(err, &incompatible) {
		return &cli.ExitError{Code: cli.ExitConflict, Err: errors.New(incompatible.Message("--restart", "--resume"))}
	}
	if errors.Is(err, batch.ErrCheckpointIncompatible) {
		return &cli.ExitError{Code: cli.ExitConflict, Err: err}
	}
	if errors.Is(err, batch.ErrSpec) {
		return &cli.ExitError{Code: cli.ExitUsage, Err: err}
	}
	return err
}

func loadSpec(ctx context.Context, pool *pgxpool.Pool, file, job string) (batch.Spec, error) {
	if file != "" {
		s, err := batch.LoadSpec(file)
		if err != nil {
			return s, cli.UsageError("BATCH_SPEC=%s: %v", file, err)
		}
		if job != "" && s.Job != job {
			return s, cli.UsageError("--job %s does not match the spec's job %s", job, s.Job)
		}
		return s, nil
	}
	s, err := batch.LoadJobSpec(ctx, pool, job)
	if errors.Is(err, batch.ErrNotFound) {
		return s, fmt.Errorf("%w: pass --spec FILE", err)
	}
	return s, err
}

func statusCommand(stdout io.Writer) cli.Command {
	var job string
	var runs int
	var asJSON bool
	return cli.DBCommand{
		Name:     "status",
		Summary:  "show runs: state, cursor, processed, rate, checkpoint age, quarantined",
		Synopsis: "Shows the newest runs of each job, one line per partition, read from batch_runs.",
		Flags: func(fs *cli.FlagSet) {
			fs.String(&job, "job", "BATCH_JOB", "", "only this job")
			fs.Int(&runs, "runs", "", 3, "runs per job to show")
			fs.Bool(&asJSON, "json", "", false, "print JSON instead of a table")
		},
		Run: func(ctx context.Context, db cli.DB) error {
			st, err := batch.Status(ctx, db.Pool, job, runs)
			if err != nil {
				return err
			}
			if asJSON {
				return cli.WriteJSON(stdout, st)
			}
			return printStatus(ctx, stdout, db.Pool, st, job, runs)
		},
	}.Command("batcher")
}

func printStatus(ctx context.Context, stdout io.Writer, pool *pgxpool.Pool, st []batch.RunStatus, job string, runs int) error {
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "JOB\tRUN\tPARTITION\tSTATE\tCURSOR\tPROCESSED\tRATE\tCKPT AGE\tQUARANTINED\tRETRIES\tATTEMPTS\tOWNER\tLAST ERROR")
	for _, s := range st {
		processed := fmt.Sprint(s.Processed)
		if s.Estimated != nil {
			processed += fmt.Sprintf("/~%d", *s.Estimated)
		}
		age := "-"
		if s.CheckpointAt != nil {
			age = s.CheckpointAge.Round(time.Second).String()
		}
		// Attempts: claims, and how many of them failed; a failed partition
		// waiting for its automatic retry says when.
		attempts := fmt.Sprintf("%d (%d failed)", s.Attempt, s.Failures)
		if s.RetryAt != nil && s.State == "pending" {
			attempts += ", retry at " + s.RetryAt.UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%.0f/s\t%s\t%d\t%d\t%s\t%s\t%s\n", s.Job, s.RunID, orDash(s.Partition), s.State,
			orDash(strings.Join(s.Cursor, ",")), processed, s.Rate, age, s.Quarantined, s.Retries, attempts, deref(s.LeaseOwner),
			strings.ReplaceAll(deref(s.LastError), "\t", " "))
	}
	if len(st) == 0 {
		fmt.Fprintln(tw, "(no runs)")
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if err := printOpenWritersWaits(ctx, stdout, pool, job); err != nil {
		return err
	}
	// A full run's sweep of rows that vanished from its scope, and a
	// relation job's rebuild of the roots of related changes (REBUILT:
	// roots read, CHANGED: documents that changed).
	sweeps, err := batch.Sweeps(ctx, pool, job, runs)
	if err != nil {
		return err
	}
	if len(sweeps) > 0 {
		fmt.Fprintln(stdout)
		tw = tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "JOB\tRUN\tSWEEP\tCURSOR\tCHECKED\tDELETED\tREBUILT\tCHANGED\tATTEMPTS\tOWNER\tERROR")
		for _, w := range sweeps {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\n", w.Job, w.RunID, w.State, deref(w.Cursor), w.Swept, w.Deleted, w.Rebuilt, w.RebuiltChanged, w.Attempt,
				deref(w.LeaseOwner), strings.ReplaceAll(deref(w.Error), "\t", " "))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	// Captured deletes (vanished: delete with the capture trigger).
	marks, err := batch.ListDeleteMarks(ctx, pool, job)
	if err != nil || len(marks) == 0 {
		return err
	}
	fmt.Fprintln(stdout)
	tw = tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "JOB\tTABLE\tDELETES DRAINED TO\tPENDING\tTOMBSTONES\tCHANGE MARK\tAT")
	for _, m := range marks {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%s\t%s\n", m.Job, m.Table, m.CaptureID, m.Pending, m.Tombstones, deref(m.ExitMark), m.UpdatedAt.UTC().Format(time.RFC3339))
	}
	return tw.Flush()
}

// printOpenWritersWaits says which run starts wait (or gave up waiting)
// for transactions that wrote the source table.
func printOpenWritersWaits(ctx context.Context, stdout io.Writer, pool *pgxpool.Pool, job string) error {
	waits, err := batch.OpenWritersWaits(ctx, pool, job)
	if err != nil || len(waits) == 0 {
		return err
	}
	fmt.Fprintln(stdout)
	for _, w := range waits {
		since := w.Since.UTC().Format(time.RFC3339)
		switch {
		case w.ExpiredAt == nil && w.Current:
			fmt.Fprintf(stdout, "job %s: a run start is waiting since %s (%s) for transactions %s that wrote %s (%s)\n",
				w.Job, since, w.CheckedAt.Sub(w.Since).Round(time.Second), w.Writers, w.Table, openWritersSetting)
		case w.ExpiredAt == nil:
			fmt.Fprintf(stdout, "job %s: a run start stopped waiting at %s (its batcher ended) after waiting since %s for transactions %s that wrote %s (%s)\n",
				w.Job, w.CheckedAt.UTC().Format(time.RFC3339), since, w.Writers, w.Table, openWritersSetting)
		default:
			what := "no run starts before they end: rerun it"
			if w.Current {
				what = "the follower tries again"
			}
			fmt.Fprintf(stdout, "job %s: a run start gave up at %s after waiting since %s for transactions %s that wrote %s (%s); %s\n",
				w.Job, w.ExpiredAt.UTC().Format(time.RFC3339), since, w.Writers, w.Table, openWritersSetting, what)
		}
	}
	return nil
}

// stateCommand is `pause` (to = paused) and `resume` (to = pending).
func stateCommand(stdout io.Writer, to string) cli.Command {
	var job, run, partition string
	verb := map[string]string{"paused": "pause", "pending": "resume"}[to]
	summary := map[string]string{
		"paused":  "pause a run (workers roll back the chunk in flight and let go)",
		"pending": "make a paused run claimable again",
	}[to]
	return cli.DBCommand{
		Name:     verb,
		Summary:  summary,
		Synopsis: "Sets the partitions of a run to " + to + ".",
		Flags: func(fs *cli.FlagSet) {
			fs.String(&job, "job", "BATCH_JOB", "", "job name (required)")
			fs.String(&run, "run-id", "BATCH_RUN_ID", "", "run (default: the job's newest)")
			fs.String(&partition, "partition", "BATCH_PARTITION", "", "only this partition")
		},
		Check: func() error {
			if job == "" {
				return cli.UsageError("--job is required")
			}
			return nil
		},
		Run: func(ctx context.Context, db cli.DB) error {
			n, err := batch.SetState(ctx, db.Pool, job, run, partition, to)
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "%d partition(s) of job %s set to %s\n", n, job, to)
			return nil
		},
	}.Command("batcher")
}

func checkpointSetCommand(stdout io.Writer) cli.Command {
	var m batch.CheckpointMove
	var cursor string
	return cli.DBCommand{
		Name:    "checkpoint set",
		Summary: "move a checkpoint by hand (audited; backwards = a new run)",
		Synopsis: "Moves a checkpoint by hand and writes checkpoint_audit. Forward skips rows (they will not be\n" +
			"processed by this run); backwards starts a new run at that position.",
		Flags: func(fs *cli.FlagSet) {
			fs.String(&m.Job, "job", "BATCH_JOB", "", "job name (required)")
			fs.String(&m.RunID, "run-id", "BATCH_RUN_ID", "", "run (required)")
			fs.String(&m.Partition, "partition", "BATCH_PARTITION", "", "partition (\"\" for a job without partitions)")
			fs.String(&cursor, "cursor", "", "", `new cursor: the cursor columns' values, comma-separated or a JSON array, e.g. '["2024-01-01 00:00:00+00","42"]' (required)`)
			fs.String(&m.Reason, "reason", "", "", "why (required; stored in the audit)")
			fs.String(&m.Actor, "actor", "USER", "", "who (stored in the audit)")
		},
		Check: func() error {
			if m.Job == "" || m.RunID == "" || cursor == "" || m.Reason == "" {
				return cli.UsageError("--job, --run-id, --cursor and --reason are required")
			}
			m.Cursor = nil
			if strings.HasPrefix(strings.TrimSpace(cursor), "[") {
				if err := json.Unmarshal([]byte(cursor), &m.Cursor); err != nil {
					return cli.UsageError("--cursor %s: %v", cursor, err)
				}
			} else {
				m.Cursor = strings.Split(cursor, ",")
			}
			return nil
		},
		Run: func(ctx context.Context, db cli.DB) error {
			res, err := batch.SetCheckpoint(ctx, db.Pool, m)
			if err != nil {
				return err
			}
			if res.NewRunID != "" {
				fmt.Fprintf(stdout, "moved back from %v to %v: new run %s (run %s superseded)\n", res.Before, res.After, res.NewRunID, m.RunID)
			} else {
				fmt.Fprintf(stdout, "moved forward from %v to %v\n", res.Before, res.After)
			}
			return nil
		},
	}.Command("batcher")
}

func quarantineListCommand(stdout io.Writer) cli.Command {
	var job string
	var all bool
	return cli.DBCommand{
		Name:     "quarantine list",
		Summary:  "list rows set aside by the quarantine policy",
		Synopsis: "Lists quarantined rows: id and error, never the payload.",
		Flags: func(fs *cli.FlagSet) {
			fs.String(&job, "job", "BATCH_JOB", "", "only this job")
			fs.Bool(&all, "all", "", false, "include resolved rows")
		},
		Run: func(ctx context.Context, db cli.DB) error {
			rows, err := batch.ListQuarantine(ctx, db.Pool, job, all)
			if err != nil {
				return err
			}
			tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "JOB\tRUN\tPARTITION\tSOURCE ID\tCODE\tMESSAGE\tATTEMPTS\tLAST SEEN\tRESOLVED")
			for _, q := range rows {
				resolved := "-"
				if q.ResolvedAt != nil {
					resolved = q.ResolvedAt.Format(time.RFC3339)
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\n", q.Job, q.RunID, orDash(q.Partition), q.SourceID, q.Code, q.Message, q.Attempts, q.LastSeen.Format(time.RFC3339), resolved)
			}
			return tw.Flush()
		},
	}.Command("batcher")
}

func quarantineRetryCommand(stdout io.Writer) cli.Command {
	var job, specFile string
	var rebuild bool
	return cli.DBCommand{
		Name:    "quarantine retry",
		Summary: "reprocess quarantined rows with the job's stored spec",
		Synopsis: "Reprocesses the job's open quarantined rows from the source table; rows that now normalize\n" +
			"are upserted, enqueued and marked resolved in one transaction per 1000 ids.",
		Flags: func(fs *cli.FlagSet) {
			fs.String(&job, "job", "BATCH_JOB", "", "job name (required unless --spec)")
			fs.String(&specFile, "spec", "BATCH_SPEC", "", "use this spec instead of the stored one (e.g. a fixed normalizer)")
			fs.Bool(&rebuild, "rebuild", "", false, "retry at a processor version that was live before and is not now (a rebuild of its generation)")
		},
		Check: func() error {
			if job == "" && specFile == "" {
				return cli.UsageError("--job or --spec is required")
			}
			return nil
		},
		Run: func(ctx context.Context, db cli.DB) error {
			spec, err := loadSpec(ctx, db.Pool, specFile, job)
			if err != nil {
				return err
			}
			res, err := batch.RetryQuarantine(ctx, db.Pool, spec, nil, batch.RetryOptions{Rebuild: rebuild})
			if err != nil {
				return classify(err)
			}
			fmt.Fprintf(stdout, "retried %d quarantined row(s) of job %s: %d resolved, %d still bad\n", res.Retried, spec.Job, res.Resolved, res.StillBad)
			return nil
		},
	}.Command("batcher")
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func deref(s *string) string {
	if s == nil || *s == "" {
		return "-"
	}
	return *s
}
