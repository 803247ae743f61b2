package sink

import (
	"context"
	"testing"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
)

// The bulk span costs nothing while tracing is off (the default).
func TestBulkSpanAllocatesNothingWhenTracingIsOff(t *testing.T) {
	docs := make([]*doc, 100)
	for i := range docs {
		docs[i] = &doc{msg: kafka.Message{Headers: []kafka.Header{{Key: "traceparent", Value: []byte("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")}}}}
	}
	ctx := context.Background()
	require.Zero(t, testing.AllocsPerRun(100, func() {
		_, span := startBulkSpan(ctx, docs)
		span.End()
	}))
}
