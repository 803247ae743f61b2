package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/shutdown"
	"github.com/outboxrelay/outboxrelay/manifest"
)

// manifestCommands returns the `manifest ...` sub-commands (issue 4).
func manifestCommands() []cli.Command {
	return manifestCommandsTo(cli.Stdout, os.Stdin)
}

func manifestCommandsTo(stdout io.Writer, stdin io.Reader) []cli.Command {
	return []cli.Command{
		manifestRegisterCommand(stdout, stdin),
		{Name: "manifest drain", Summary: "apply the next chunks of a manifest job, one verified transaction per chunk", Run: func(ctx context.Context, args []string) error {
			return manifestDrain(ctx, args, stdout)
		}},
		manifestReportCommand(stdout),
		manifestStatusCommand(stdout),
	}
}

func manifestRegisterCommand(stdout io.Writer, stdin io.Reader) cli.Command {
	var file string
	var asJSON bool
	var spec manifest.Spec
	return cli.DBCommand{
		Name:    "manifest register",
		Summary: "freeze an approved list of items as a manifest job (idempotent; conflict exits 3)",
		Synopsis: `Registers the approved list in a manifest file (JSON) as a frozen job. Items are sorted
by id. The same job id with the same content (in any order) is the same job: nothing
changes, exit 0. The same job id with other content is refused with exit code 3.

File format:
  {"job_id": "festival-cancel", "tenant": "alien-desserts",
   "target": {"table": "orders", "id_column": "id", "tenant_column": "tenant_id",
              "revision_column": "revision", "status_column": "status", "match_fields": ["qty"]},
   "transition": {"from": "pending", "to": "cancelled"},
   "chunk_size": 10, "topic": "outboxrelay.orders",
   "items": [{"id": 15, "revision": 1, "fields": {"qty": 2}}, ...]}`,
		Logging: true,
		Flags: func(fs *cli.FlagSet) {
			fs.String(&file, "file", "MANIFEST_FILE", "", `the manifest file ("-" = standard input) (required)`)
			fs.Bool(&asJSON, "json", "", false, "print the registered job as JSON")
		},
		// The file is read and checked before anything connects.
		Check: func() error {
			if file == "" {
				return cli.UsageError("--file is required (the approved manifest, JSON)")
			}
			var r io.Reader = stdin
			if file != "-" {
				f, err := os.Open(file)
				if err != nil {
					return cli.UsageError("--file: %v", err)
				}
				defer f.Close()
				r = f
			}
			var err error
			if spec, err = manifest.Parse(r); err != nil {
				return cli.UsageError("%s: %v", file, err)
			}
			return nil
		},
		Run: func(ctx context.Context, db cli.DB) error {
			reg, err := manifest.Register(ctx, db.Pool, spec)
			if errors.Is(err, manifest.ErrRegistrationConflict) {
				return &cli.ExitError{Code: cli.ExitConflict, Err: err}
			}
			if err != nil {
				return err
			}
			if asJSON {
				return cli.WriteJSON(stdout, reg)
			}
			j := reg.Job
			if reg.Created {
				fmt.Fprintf(stdout, "registered manifest job %s: %d items, chunk size %d, tenant %s, %s.%s %s → %s\n",
					j.JobID, j.ItemCount, j.ChunkSize, j.Tenant, j.Target.Table, j.Target.StatusColumn, j.Transition.From, j.Transition.To)
				return nil
			}
			fmt.Fprintf(stdout, "manifest job %s is already registered with the same content (%d items, state %s, next_index %d); nothing changed\n",
				j.JobID, j.ItemCount, j.State, j.NextIndex)
			return nil
		},
	}.Command("batcher")
}

func manifestDrain(ctx context.Context, args []string, stdout io.Writer) error {
	var c cli.Common
	var job string
	var maxChunks int
	var lockTimeout, idleTimeout, grace time.Duration
	var asJSON bool
	fs := cli.NewFlagSet("batcher manifest drain", `Applies the next chunks of a manifest job. Each chunk is one transaction: lock the job,
verify progress against the audit, conditionally update the chunk's rows, audit them,
enqueue outbox events, advance next_index. Stops when the job completes (also when another
worker completed it), after --max-chunks, or at the first conflict or error, which is not
retried. Exit codes: 0 done or stopped, 3 the job is conflicted (a new approval is needed),
1 progress verification failed or another error (nothing changed by the failing chunk).
SIGINT/SIGTERM: finish the chunk in flight, then exit 0; a second signal aborts it.`)
	c.RegisterDatabase(fs)
	c.RegisterLogging(fs)
	fs.String(&job, "job", "MANIFEST_JOB", "", "the manifest job id (required)")
	fs.Int(&maxChunks, "max-chunks", "MANIFEST_MAX_CHUNKS", 0, "commit at most this many chunks (0 = until the job completes)")
	fs.Duration(&lockTimeout, "lock-timeout", "MANIFEST_LOCK_TIMEOUT", manifest.DefaultLockTimeout, "how long a chunk waits for a target row another writer locked (0 = default, negative = forever)")
	fs.Duration(&idleTimeout, "idle-timeout", "MANIFEST_IDLE_TIMEOUT", manifest.DefaultIdleTimeout, "how long a chunk transaction may sit idle holding the job row before the server ends it, so a stuck drainer cannot block the job (negative = forever)")
	fs.Duration(&grace, "grace", "SHUTDOWN_GRACE", 30*time.Second, "after the first SIGINT/SIGTERM, how long the chunk in flight may take before it is aborted")
	fs.Bool(&asJSON, "json", "", false, "print the result as JSON at the end instead of text lines")
	if _, err := fs.Parse(args); err != nil {
		return err
	}
	if job == "" {
		return cli.UsageError("--job is required")
	}
	if maxChunks < 0 {
		return cli.UsageError("--max-chunks=%d: must be >= 0 (0 = until the job completes)", maxChunks)
	}
	logger, err := c.Logger()
	if err != nil {
		return err
	}
	soft, hard, stop := shutdown.Contexts(ctx, grace, logger)
	defer stop()
	pool, err := c.OpenDB(hard, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	opts := manifest.DrainOptions{MaxChunks: maxChunks, LockTimeout: lockTimeout, IdleTimeout: idleTimeout, Stop: soft.Done(), Logger: logger}
	if !asJSON {
		opts.OnChunk = func(ch manifest.Chunk) {
			fmt.Fprintf(stdout, "chunk %d committed: positions %d..%d, %d item(s) changed, %d event(s); next_index %d of %d\n",
				ch.Chunk, ch.From, ch.To-1, len(ch.IDs), ch.Events, ch.NextIndex, ch.ItemCount)
		}
	}
	res, err := manifest.Drain(hard, pool, job, opts)
	if asJSON && res.JobID != "" {
		if werr := cli.WriteJSON(stdout, res); werr != nil && err == nil {
			err = werr
		}
	} else if res.JobID != "" && res.Stopped != "" {
		fmt.Fprintf(stdout, "job %s: %d chunk(s), %d item(s) changed by this call; next_index %d of %d; state %s; stopped: %s\n",
			job, len(res.Chunks), len(res.ProcessedIDs), res.NextIndex, res.ItemCount, res.State, res.Stopped)
	}
	if errors.Is(err, manifest.ErrConflicted) {
		return &cli.ExitError{Code: cli.ExitConflict, Err: err}
	}
	return err
}

func manifestReportCommand(stdout io.Writer) cli.Command {
	var job string
	var asJSON bool
	return cli.DBCommand{
		Name:    "manifest report",
		Summary: "approved, committed and unprocessed ids of a manifest job and the current state of each",
		Synopsis: `Prints the approved, committed and unprocessed ids of a manifest job and, for each
committed id, whether its row is matching (as the chunk left it), drifted (changed since)
or missing (deleted). Progress, audit and rows are read in one snapshot (a REPEATABLE READ
read-only transaction), so a drain committing meanwhile cannot make it disagree with itself.`,
		Flags: func(fs *cli.FlagSet) {
			fs.String(&job, "job", "MANIFEST_JOB", "", "the manifest job id (required)")
			fs.Bool(&asJSON, "json", "", false, "print JSON instead of a table")
		},
		Check: func() error {
			if job == "" {
				return cli.UsageError("--job is required")
			}
			return nil
		},
		Run: func(ctx context.Context, db cli.DB) error {
			rep, err := manifest.ReadReport(ctx, db.Pool, job)
			if err != nil {
				return err
			}
			if asJSON {
				return cli.WriteJSON(stdout, rep)
			}
			_, err = io.WriteString(stdout, rep.String())
			return err
		},
	}.Command("batcher")
}

func manifestStatusCommand(stdout io.Writer) cli.Command {
	var asJSON bool
	return cli.DBCommand{
		Name:     "manifest status",
		Summary:  "list manifest jobs with state and progress",
		Synopsis: "Lists manifest jobs: state, progress, chunks done, last change.",
		Flags: func(fs *cli.FlagSet) {
			fs.Bool(&asJSON, "json", "", false, "print JSON instead of a table")
		},
		Run: func(ctx context.Context, db cli.DB) error {
			jobs, err := manifest.ListJobs(ctx, db.Pool)
			if err != nil {
				return err
			}
			if asJSON {
				if jobs == nil {
					jobs = []manifest.Job{}
				}
				return cli.WriteJSON(stdout, jobs)
			}
			tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "JOB\tTENANT\tSTATE\tPROGRESS\tCHUNK\tCHUNKS DONE\tUPDATED\tCONFLICT")
			for _, j := range jobs {
				conflict := ""
				if j.Conflict != nil {
					conflict = j.Conflict.String()
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d/%d\t%d\t%d\t%s\t%s\n", j.JobID, j.Tenant, j.State, j.NextIndex, j.ItemCount,
					j.ChunkSize, j.ChunksDone, j.UpdatedAt.UTC().Format(time.RFC3339), strings.ReplaceAll(conflict, "\t", " "))
			}
			return tw.Flush()
		},
	}.Command("batcher")
}
