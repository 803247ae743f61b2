package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/pgconn"
	"github.com/outboxrelay/outboxrelay/outbox"
)

func statusCommand(stdout io.Writer) cli.Command {
	return cli.Command{
		Name:    "status",
		Summary: "print backlog per shard, oldest unpublished event, leases and owners, publishers, dead letters",
		Run: func(ctx context.Context, args []string) error {
			var c cli.Common
			var all bool
			fs := cli.NewFlagSet("publisher status", "Reads the outbox, lease and dead-letter tables (the database is the source of truth).")
			c.RegisterDatabase(fs)
			fs.Bool(&all, "all-shards", "", false, "list every shard, not only those with a backlog or an owner")
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			pool, err := pgconn.Open(ctx, c.DatabaseURL, 2)
			if err != nil {
				return err
			}
			defer pool.Close()
			r, err := outbox.Status(ctx, pool)
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "backlog: %d event(s), oldest %s; dead letters: %d; retained published: %d\n\n",
				r.Backlog, r.OldestAge, r.DeadLetters, r.Retained)
			tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "PUBLISHER\tALIVE\tSHARDS\tSTARTED\tLAST HEARTBEAT")
			for _, p := range r.Publishers {
				fmt.Fprintf(tw, "%s\t%t\t%d\t%s\t%s ago\n", p.ID, p.Alive, p.Shards, p.StartedAt.Format(time.RFC3339), time.Since(p.HeartbeatAt).Round(time.Millisecond))
			}
			tw.Flush()
			fmt.Fprintln(stdout)
			tw = tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "SHARD\tBACKLOG\tOLDEST\tOWNER\tEPOCH\tLEASE")
			for _, s := range r.Shards {
				if !all && s.Backlog == 0 && s.Owner == "" {
					continue
				}
				lease := "free"
				switch {
				case s.Owner != "" && s.LeaseExpiresIn > 0:
					lease = "expires in " + s.LeaseExpiresIn.String()
				case s.Owner != "":
					lease = "expired " + (-s.LeaseExpiresIn).String() + " ago"
				}
				fmt.Fprintf(tw, "%d\t%d\t%s\t%s\t%d\t%s\n", s.Shard, s.Backlog, s.OldestAge, dash(s.Owner), s.Epoch, lease)
			}
			return tw.Flush()
		},
	}
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func deadLetterListCommand(stdout io.Writer) cli.Command {
	return cli.Command{
		Name:    "dead-letter list",
		Summary: "list events the broker rejected permanently (oldest first)",
		Run: func(ctx context.Context, args []string) error {
			var c cli.Common
			var limit int
			fs := cli.NewFlagSet("publisher dead-letter list", "Lists outbox_dead_letters: the event, its size and the broker's error.")
			c.RegisterDatabase(fs)
			fs.Int(&limit, "limit", "", 100, "most rows to print")
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			pool, err := pgconn.Open(ctx, c.DatabaseURL, 2)
			if err != nil {
				return err
			}
			defer pool.Close()
			dls, err := outbox.ListDeadLetters(ctx, pool, limit)
			if err != nil {
				return err
			}
			tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tEVENT ID\tTOPIC\tAGGREGATE\tVERSION\tTYPE\tBYTES\tFAILED AT\tERROR")
			for _, d := range dls {
				fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\t%d\t%s\t%s\n", d.ID, d.EventID, d.Topic, d.AggregateID, d.AggregateVersion,
					d.EventType, d.PayloadBytes, d.FailedAt.Format(time.RFC3339), d.Error)
			}
			return tw.Flush()
		},
	}
}

func deadLetterRetryCommand(stdout io.Writer) cli.Command {
	return cli.Command{
		Name:    "dead-letter retry",
		Summary: "move dead letters back into the outbox (--ids 1,2,3 or --all)",
		Run: func(ctx context.Context, args []string) error {
			var c cli.Common
			var idList string
			var all bool
			fs := cli.NewFlagSet("publisher dead-letter retry", "Re-enqueues dead letters into outbox_events (after fixing the cause, e.g. raising\nmessage.max.bytes). They are published after the events already queued for their key.")
			c.RegisterDatabase(fs)
			fs.String(&idList, "ids", "", "", "comma-separated dead-letter ids (see dead-letter list)")
			fs.Bool(&all, "all", "", false, "retry every dead letter")
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			var ids []int64
			for _, s := range strings.Split(idList, ",") {
				if s = strings.TrimSpace(s); s == "" {
					continue
				}
				id, err := strconv.ParseInt(s, 10, 64)
				if err != nil {
					return cli.UsageError("--ids: %q is not a dead-letter id", s)
				}
				ids = append(ids, id)
			}
			if all == (len(ids) > 0) {
				return cli.UsageError("give exactly one of --ids or --all")
			}
			pool, err := pgconn.Open(ctx, c.DatabaseURL, 2)
			if err != nil {
				return err
			}
			defer pool.Close()
			n, err := outbox.RetryDeadLetters(ctx, pool, ids)
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "%d dead letter(s) moved back to the outbox\n", n)
			return nil
		},
	}
}
