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
	"github.com/outboxrelay/outboxrelay/outbox"
)

func statusCommand(stdout io.Writer) cli.Command {
	var all bool
	return cli.DBCommand{
		Name:     "status",
		Summary:  "print backlog per shard, oldest unpublished event, leases and owners, publishers, dead letters",
		Synopsis: "Reads the outbox, lease and dead-letter tables (the database is the source of truth).",
		Flags: func(fs *cli.FlagSet) {
			fs.Bool(&all, "all-shards", "", false, "list every shard, not only those with a backlog or an owner")
		},
		Run: func(ctx context.Context, db cli.DB) error {
			r, err := outbox.Status(ctx, db.Pool)
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
	}.Command("publisher")
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func deadLetterListCommand(stdout io.Writer) cli.Command {
	var limit int
	return cli.DBCommand{
		Name:     "dead-letter list",
		Summary:  "list events the broker rejected permanently (oldest first)",
		Synopsis: "Lists outbox_dead_letters: the event, its size and the broker's error.",
		Flags: func(fs *cli.FlagSet) {
			fs.Int(&limit, "limit", "", 100, "most rows to print")
		},
		Run: func(ctx context.Context, db cli.DB) error {
			dls, err := outbox.ListDeadLetters(ctx, db.Pool, limit)
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
	}.Command("publisher")
}

func deadLetterRetryCommand(stdout io.Writer) cli.Command {
	var idList string
	var all bool
	var ids []int64
	return cli.DBCommand{
		Name:    "dead-letter retry",
		Summary: "move dead letters back into the outbox (--ids 1,2,3 or --all)",
		Synopsis: "Re-enqueues dead letters into outbox_events (after fixing the cause, e.g. raising\n" +
			"message.max.bytes). They are published after the events already queued for their key.",
		Flags: func(fs *cli.FlagSet) {
			fs.String(&idList, "ids", "", "", "comma-separated dead-letter ids (see dead-letter list)")
			fs.Bool(&all, "all", "", false, "retry every dead letter")
		},
		Check: func() error {
			ids = nil
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
			return nil
		},
		Run: func(ctx context.Context, db cli.DB) error {
			n, err := outbox.RetryDeadLetters(ctx, db.Pool, ids)
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "%d dead letter(s) moved back to the outbox\n", n)
			return nil
		},
	}.Command("publisher")
}
