// Command indexer consumes Kafka and upserts into Elasticsearch/OpenSearch by source id and source version.
package main

import (
	"context"
	"os"

	"github.com/outboxrelay/outboxrelay/internal/cli"
)

func main() {
	cli.Main(context.Background(), "indexer", "consumes Kafka and upserts into Elasticsearch/OpenSearch by source id and source version", commands())
}

func commands() []cli.Command {
	return []cli.Command{
		cli.MigrateCommand("indexer", os.Stdout),
		runCommand(),
		statusCommand(os.Stdout),
		replayCommand(os.Stdout),
		reindexCommand(os.Stdout),
		reconcileCommand(os.Stdout),
		cutoverCommand(os.Stdout),
		rollbackCommand(os.Stdout),
		dropCommand(os.Stdout),
	}
}
