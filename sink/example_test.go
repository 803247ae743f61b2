package sink_test

import (
	"context"
	"log"
	"os"
	"os/signal"

	"github.com/outboxrelay/outboxrelay/sink"
)

// Run an indexer until SIGINT. Offsets are committed only after every
// document of a batch is indexed, a stale replay (409) or dead-lettered.
func ExampleNew() {
	ix, err := sink.New(sink.Config{
		Brokers: []string{"127.0.0.1:9092"},
		URL:     "http://127.0.0.1:9200",
		// Topic "outboxrelay.records", group "outboxrelay-indexer", read
		// alias "records" and write alias "records-write" by default.
		MaxRate: 5000, // documents per second for the whole process
	})
	if err != nil {
		log.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := ix.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
