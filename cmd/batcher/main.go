// Command batcher reads source tables in chunks into normalized rows and outbox events, one transaction per chunk.
package main

import (
	"context"
	"os"

	"github.com/outboxrelay/outboxrelay/internal/cli"
)

func main() {
	cli.Main(context.Background(), "batcher", "reads source tables in chunks into normalized rows and outbox events, one transaction per chunk", commands())
}

func commands() []cli.Command {
	cmds := []cli.Command{
		cli.MigrateCommand("batcher", os.Stdout),
	}
	cmds = append(cmds, scanCommands(os.Stdout)...)
	cmds = append(cmds, manifestCommands()...)
	cmds = append(cmds, followCommands(os.Stdout)...)
	return append(cmds, demoCommands(os.Stdout)...)
}
