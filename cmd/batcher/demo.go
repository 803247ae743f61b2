package main

import (
	"context"
	"fmt"
	"io"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/demo"
)

// demoCommands returns `demo seed` and `demo change`, which create and
// change the demo source table (source_records) for trying the pipeline.
func demoCommands(stdout io.Writer) []cli.Command {
	var rows, bad, comments int
	var update, del, salt int
	return []cli.Command{
		cli.DBCommand{
			Name:    "demo seed",
			Summary: "create the demo tables source_records and record_comments and fill them (for trying the pipeline)",
			Synopsis: "Creates source_records (id, created_at, tenant_id, version, change_seq, deleted_at,\n" +
				"payload) with its update trigger, and record_comments (comments on records, nested in the\n" +
				"demo job's documents), when missing, and appends rows of ~500-byte payloads.\n" +
				"Run the demo job on it: batcher run --spec demo/job.yaml",
			Flags: func(fs *cli.FlagSet) {
				fs.Int(&rows, "rows", "ROWS", 200_000, "rows to append")
				fs.Int(&bad, "bad-every", "", 0, "make every N-th row malformed (no title), to try the quarantine; 0 = none")
				fs.Int(&comments, "comments-every", "", 3, "give every N-th row two comments in record_comments (nested in the demo job's documents); 0 = none")
			},
			Check: func() error {
				if rows <= 0 {
					return cli.UsageError("ROWS=%d: want a positive number", rows)
				}
				return nil
			},
			Run: func(ctx context.Context, db cli.DB) error {
				if err := demo.Seed(ctx, db.Pool, demo.SeedOptions{Rows: rows, BadEvery: bad, CommentEvery: comments}); err != nil {
					return err
				}
				fmt.Fprintf(stdout, "source_records: %d rows appended\n", rows)
				return nil
			},
		}.Command("batcher"),
		cli.DBCommand{
			Name:    "demo change",
			Summary: "update and soft-delete some demo rows (their version goes up), to watch the index follow",
			Synopsis: "Gives about every N-th live row of source_records a new title and soft-deletes about\n" +
				"every M-th; the table's trigger bumps version and change_seq. Then run the job again.",
			Flags: func(fs *cli.FlagSet) {
				fs.Int(&update, "update-every", "", 100, "update about one row in N (0 = none)")
				fs.Int(&del, "delete-every", "", 250, "soft-delete about one row in M (0 = none)")
				fs.Int(&salt, "salt", "", 1, "vary which rows are picked")
			},
			Run: func(ctx context.Context, db cli.DB) error {
				ch, err := demo.Mutate(ctx, db.Pool, update, del, salt)
				if err != nil {
					return err
				}
				fmt.Fprintf(stdout, "source_records: %d rows updated, %d soft-deleted\n", ch.Updated, ch.Deleted)
				return nil
			},
		}.Command("batcher"),
	}
}
