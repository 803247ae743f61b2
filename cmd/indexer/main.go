// Command indexer consumes Kafka and upserts into Elasticsearch/OpenSearch by source id and source version.
package main

import (
	"context"

	"github.com/outboxrelay/outboxrelay/internal/cli"
)

func main() {
	cli.Main(context.Background(), "indexer", "consumes Kafka and upserts into Elasticsearch/OpenSearch by source id and source version", commands())
}

func commands() []cli.Command {
	return []cli.Command{
		cli.MigrateCommand("indexer", cli.Stdout),
		runCommand(),
		statusCommand(cli.Stdout),
		replayCommand(cli.Stdout),
		reindexCommand(cli.Stdout),
		reconcileCommand(cli.Stdout),
		cutoverCommand(cli.Stdout),
		rollbackCommand(cli.Stdout),
		dropCommand(cli.Stdout),
		purgeCommand(cli.Stdout),
	}
}
