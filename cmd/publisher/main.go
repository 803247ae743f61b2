// Command publisher drains the transactional outbox to Kafka, at-least-once and ordered per key.
package main

import (
	"context"
	"os"

	"github.com/outboxrelay/outboxrelay/internal/cli"
)

func main() {
	cli.Main(context.Background(), "publisher", "drains the transactional outbox to Kafka, at-least-once and ordered per key", commands())
}

func commands() []cli.Command {
	return []cli.Command{
		cli.MigrateCommand("publisher", os.Stdout),
		runCommand(),
		statusCommand(os.Stdout),
		deadLetterListCommand(os.Stdout),
		deadLetterRetryCommand(os.Stdout),
		topicsEnsureCommand(os.Stdout),
		notifyCommand(os.Stdout, "on"),
		notifyCommand(os.Stdout, "off"),
		notifyCommand(os.Stdout, "status"),
	}
}
