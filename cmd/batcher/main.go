// Command batcher reads source tables in chunks into normalized rows and outbox events, one transaction per chunk.
package main

import (
	"context"

	"github.com/outboxrelay/outboxrelay/internal/cli"
)

func main() {
	cli.Main(context.Background(), "batcher", "reads source tables in chunks into normalized rows and outbox events, one transaction per chunk", commands())
}

func commands() []cli.Command {
	cmds := []cli.Command{
		cli.MigrateCommand("batcher", cli.Stdout),
	}
	cmds = append(cmds, scanCommands(cli.Stdout)...)
	cmds = append(cmds, manifestCommands()...)
	cmds = append(cmds, followCommands(cli.Stdout)...)
	return append(cmds, demoCommands(cli.Stdout)...)
}
