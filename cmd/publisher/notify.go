package main

import (
	"context"
	"fmt"
	"io"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// notifyCommand is `publisher notify on|off|status`: the outbox's NOTIFY
// trigger, which wakes publishers at once but serialises the commits of
// concurrent outbox writers on PostgreSQL's notify lock.
func notifyCommand(stdout io.Writer, verb string) cli.Command {
	summary := map[string]string{
		"on":     "turn the outbox NOTIFY trigger on (idle publishers wake at once on every commit; the default)",
		"off":    "turn the outbox NOTIFY trigger off (writers commit without the global notify lock; publishers poll)",
		"status": "print whether the outbox NOTIFY trigger is on",
	}[verb]
	return cli.DBCommand{
		Name:    "notify " + verb,
		Summary: summary,
		Synopsis: "NOTIFY takes PostgreSQL's global notify lock from each commit that writes the outbox until\n" +
			"the commit is flushed, so many concurrent writers commit one after another. Off, publishers\n" +
			"find idle shards by polling every POLL_INTERVAL instead (set it to about 100ms).",
		Conns: 1,
		Run: func(ctx context.Context, db cli.DB) error {
			if verb != "status" {
				if err := outbox.SetNotify(ctx, db.Pool, verb == "on"); err != nil {
					return err
				}
			}
			on, err := outbox.NotifyEnabled(ctx, db.Pool)
			if err != nil {
				return err
			}
			state := "off: publishers poll every POLL_INTERVAL"
			if on {
				state = "on"
			}
			fmt.Fprintf(stdout, "outbox NOTIFY trigger: %s\n", state)
			return nil
		},
	}.Command("publisher")
}
