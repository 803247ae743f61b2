package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// COMPRESSION is the codec of the record batches on the topic, as the broker
// stores them and a consumer receives them; the events arrive unchanged.
func TestPublisherCompressesBatches(t *testing.T) {
	t.Parallel()
	brokers := stack.KafkaBrokers(t)
	tests := []struct {
		name  string
		codec uint8 // the batch attributes' compression bits
	}{
		{name: "none", codec: 0},
		{name: "lz4", codec: 3},
		{name: "zstd", codec: 4},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			pool := stack.Pool(t, stack.Database(t))
			topic := createTopic(t, brokers, 1)
			const n = 200
			insertEvents(t, pool, topic, 10, 0, n, 100)
			startPublisher(t, pool, outbox.Config{Brokers: brokers, Compression: tt.name})

			cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
			require.NoError(t, err)
			t.Cleanup(cl.Close)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			want := wantIDs(topic, 10, 0, n)
			for len(want) > 0 {
				fs := cl.PollFetches(ctx)
				require.NoError(t, ctx.Err(), "%d events not received", len(want))
				for _, e := range fs.Errors() {
					require.NoError(t, e.Err)
				}
				fs.EachRecord(func(r *kgo.Record) {
					require.Equal(t, tt.codec, r.Attrs.CompressionType(), "compression of the batch holding %s", r.Key)
					require.Contains(t, string(r.Value), `"pad"`)
					for _, h := range r.Headers {
						if h.Key == outbox.HeaderID {
							delete(want, string(h.Value))
						}
					}
				})
			}
		})
	}
	_, err := outbox.NewPublisher(stack.Pool(t, stack.Database(t)), outbox.Config{Brokers: brokers, Compression: "brotli"})
	require.ErrorContains(t, err, `COMPRESSION="brotli"`)
}
