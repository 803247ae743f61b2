package sink

import (
	"context"
	"log/slog"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/outboxrelay/outboxrelay/index"
)

// caughtUp reports whether the batch brought every partition it holds to
// within one batch (slack messages) of the partition's high watermark when
// its last message was fetched. Not "at the high watermark": under a steady
// stream a full batch often ends partway through one of its partitions, and
// a first generation would stay unrefreshed, so unsearchable, for as long as
// the stream lasted.
func caughtUp(docs []*doc, slack int) bool {
	last := map[int]*doc{}
	for _, d := range docs {
		last[d.msg.Partition] = d
	}
	for _, d := range last {
		if d.msg.HighWaterMark-(d.msg.Offset+1) >= int64(slack) {
			return false
		}
	}
	return len(last) > 0
}

// finishBulkLoads takes every generation this router found in bulk-load
// mode out of it, once a batch reached the end of its partitions. A failure
// is logged and tried again after the next such batch.
func (r *router) finishBulkLoads(ctx context.Context, docs []*doc) {
	r.mu.Lock()
	pending := make([]string, 0, len(r.bulk))
	for idx := range r.bulk {
		pending = append(pending, idx)
	}
	r.mu.Unlock()
	if len(pending) == 0 || !caughtUp(docs, r.slack) {
		return
	}
	for _, idx := range pending {
		b := backoff.WithContext(backoff.WithMaxRetries(backoff.NewExponentialBackOff(backoff.WithInitialInterval(200*time.Millisecond)), 3), ctx)
		err := backoff.Retry(func() error {
			err := index.FinishBulkLoad(ctx, r.client, idx)
			if err != nil && !index.IsRetryable(err) {
				return backoff.Permanent(err)
			}
			return err
		}, b)
		if err != nil {
			r.log.Warn("could not end the bulk load of an index generation (tried again after the next batch that catches up)",
				slog.String("index", idx), slog.Any("error", err))
			continue
		}
		r.log.Info("index generation caught up: refresh and replicas restored", slog.String("index", idx))
		r.mu.Lock()
		delete(r.bulk, idx)
		r.mu.Unlock()
	}
}
