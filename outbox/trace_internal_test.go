package outbox

import (
	"context"
	"testing"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
)

// The publish span costs nothing while tracing is off (the default).
func TestPublishSpanAllocatesNothingWhenTracingIsOff(t *testing.T) {
	all := make([]pendingEvent, 100)
	for i := range all {
		all[i].msg = kafka.Message{Headers: []kafka.Header{{Key: HeaderTraceParent, Value: []byte("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")}}}
	}
	ctx := context.Background()
	require.Zero(t, testing.AllocsPerRun(100, func() {
		_, span := startPublishSpan(ctx, all)
		span.End()
	}))
}
