package main

import (
	"context"
	"fmt"
	"io"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/demo"
	"github.com/outboxrelay/outboxrelay/internal/pgconn"
)

// demoCommands returns `demo seed` and `demo change`, which create and
// change the demo source table (source_records) for trying the pipeline.
func demoCommands(stdout io.Writer) []cli.Command {
	return []cli.Command{
		{
			Name:    "demo seed",
			Summary: "create the demo table source_records and fill it (for trying the pipeline)",
			Run: func(ctx context.Context, args []string) error {
				var c cli.Common
				var rows, bad int
				fs := cli.NewFlagSet("batcher demo seed", "Creates source_records (id, created_at, tenant_id, version, change_seq, deleted_at,\npayload) with its update trigger when missing and appends rows of ~500-byte payloads.\nRun the demo job on it: batcher run --spec demo/job.yaml")
				c.RegisterDatabase(fs)
				fs.Int(&rows, "rows", "ROWS", 200_000, "rows to append")
				fs.Int(&bad, "bad-every", "", 0, "make every N-th row malformed (no title), to try the quarantine; 0 = none")
				if _, err := fs.Parse(args); err != nil {
					return err
				}
				if rows <= 0 {
					return cli.UsageError("ROWS=%d: want a positive number", rows)
				}
				pool, err := pgconn.Open(ctx, c.DatabaseURL, 2)
				if err != nil {
					return err
				}
				defer pool.Close()
				if err := demo.Seed(ctx, pool, demo.SeedOptions{Rows: rows, BadEvery: bad}); err != nil {
					return err
				}
				fmt.Fprintf(stdout, "source_records: %d rows appended\n", rows)
				return nil
			},
		},
		{
			Name:    "demo change",
			Summary: "update and soft-delete some demo rows (their version goes up), to watch the index follow",
			Run: func(ctx context.Context, args []string) error {
				var c cli.Common
				var update, del, salt int
				fs := cli.NewFlagSet("batcher demo change", "Gives about every N-th live row of source_records a new title and soft-deletes about\nevery M-th; the table's trigger bumps version and change_seq. Then run the job again.")
				c.RegisterDatabase(fs)
				fs.Int(&update, "update-every", "", 100, "update about one row in N (0 = none)")
				fs.Int(&del, "delete-every", "", 250, "soft-delete about one row in M (0 = none)")
				fs.Int(&salt, "salt", "", 1, "vary which rows are picked")
				if _, err := fs.Parse(args); err != nil {
					return err
				}
				pool, err := pgconn.Open(ctx, c.DatabaseURL, 2)
				if err != nil {
					return err
				}
				defer pool.Close()
				ch, err := demo.Mutate(ctx, pool, update, del, salt)
				if err != nil {
					return err
				}
				fmt.Fprintf(stdout, "source_records: %d rows updated, %d soft-deleted\n", ch.Updated, ch.Deleted)
				return nil
			},
		},
	}
}
