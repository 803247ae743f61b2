// Command publisher drains the transactional outbox to Kafka, at-least-once and ordered per key.
package main

import (
	"context"
	"io"

	"github.com/outboxrelay/outboxrelay/internal/cli"
)

func main() {
	cli.Main(context.Background(), "publisher", "drains the transactional outbox to Kafka, at-least-once and ordered per key", commands(cli.Stdout))
}

func commands(stdout io.Writer) []cli.Command {
	return []cli.Command{
		cli.MigrateCommand("publisher", stdout),
		runCommand(),
		statusCommand(stdout),
		deadLetterListCommand(stdout),
		deadLetterRetryCommand(stdout),
		topicsEnsureCommand(stdout),
		notifyCommand(stdout, "on"),
		notifyCommand(stdout, "off"),
		notifyCommand(stdout, "status"),
	}
}
