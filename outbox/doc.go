// Package outbox is outboxrelay's transactional outbox: the write side
// ([Enqueue], used by the batcher and by application code in its own
// transactions) and the publisher that drains outbox_events to Kafka.
//
// Enqueue events in the same transaction as the writes they describe:
//
//	tx, _ := pool.Begin(ctx)
//	// ... the application's own writes ...
//	_, err := outbox.Enqueue(ctx, tx, outbox.Event{
//		ID:               outbox.EventID("orders", "42", 7, "v1"),
//		Topic:            "orders",
//		AggregateType:    "order",
//		AggregateID:      "42",
//		AggregateVersion: 7,
//		Payload:          json.RawMessage(`{"status":"cancelled"}`),
//	})
//	// ... tx.Commit(ctx)
package outbox
