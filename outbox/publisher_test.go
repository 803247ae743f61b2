package outbox_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

func TestPublishRecordContract(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	brokers := stack.KafkaBrokers(t)
	pool := stack.Pool(t, stack.Database(t))
	topic := createTopic(t, brokers, 3)
	tp := "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	// Sent byte for byte as written: key order, spacing and escapes kept.
	const doc = `{"status":"cancelled",  "lines": [2, 1], "note":"caf\u00e9"}`
	up := outbox.Event{ID: outbox.EventID("orders", "42", 3, "v1"), Topic: topic, AggregateType: "order", AggregateID: "42",
		AggregateVersion: 3, Payload: json.RawMessage(doc), Headers: map[string]string{"traceparent": tp}}
	del := outbox.Event{ID: outbox.EventID("orders", "42", 4, "v1"), Topic: topic, AggregateType: "order", AggregateID: "42",
		AggregateVersion: 4, Type: outbox.TypeDelete}
	_, err := outbox.Enqueue(ctx, pool, up, del)
	require.NoError(t, err)
	startPublisher(t, pool, outbox.Config{Brokers: brokers})

	msgs := consumeAll(t, brokers, topic, map[string]bool{up.ID: true, del.ID: true}, time.Minute)
	require.Len(t, msgs, 2)
	m := msgs[0]
	require.Equal(t, "42", m.key)
	require.Equal(t, doc, string(m.value))
	require.Equal(t, map[string]string{
		outbox.HeaderSpecVersion: "1.0", outbox.HeaderID: up.ID, outbox.HeaderSource: "outboxrelay",
		outbox.HeaderType: "outboxrelay.upsert", outbox.HeaderSubject: "42", outbox.HeaderTime: m.headers[outbox.HeaderTime],
		outbox.HeaderAggregateVersion: "3", outbox.HeaderAggregateType: "order", outbox.HeaderContentType: "application/json",
		outbox.HeaderTraceParent: tp,
	}, m.headers)
	_, err = time.Parse(time.RFC3339Nano, m.headers[outbox.HeaderTime])
	require.NoError(t, err)
	require.Nil(t, msgs[1].value, "a delete is a Kafka tombstone")
	require.Equal(t, "outboxrelay.delete", msgs[1].headers[outbox.HeaderType])
	waitFor(t, 30*time.Second, "outbox to drain", func() bool { return outboxCount(t, pool) == 0 })
}
