package sink

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/olivere/elastic/v7"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// The real engine refuses a whole bulk request with 400 when one _id is
// longer than 512 bytes. parse catches that id before the request; this
// test gets one past it (as any other request-level 400 that parse does
// not know of would) to hold the bisection to the real engine's answer.
func TestBisectRequestLevel400RealEngine(t *testing.T) {
	t.Parallel()
	real := stack.ElasticsearchURL(t)
	f := newFixture(t, real, real, 1)
	ix, err := New(f.cfg)
	require.NoError(t, err)
	ctx := context.Background()
	_, err = index.Ensure(ctx, ix.client, ix.cfg.Alias, ix.cfg.WriteAlias, ix.cfg.Mapping)
	require.NoError(t, err)
	require.NoError(t, ensureTopic(ctx, ix.cfg.Brokers, ix.cfg.DeadLetterTopic, 1))
	defer ix.dlq.Close()

	var batch []*doc
	for i := range 10 {
		d := ix.rules.parse(upsert(fmt.Sprintf("d%d", i), 1, docN(i)).message())
		require.Nil(t, d.poison)
		batch = append(batch, d)
	}
	long := strings.Repeat("k", MaxIDBytes+1)
	batch[6].id = long // past parse's check
	batch[6].msg = kafka.Message{Key: []byte(long), Value: batch[6].msg.Value, Headers: batch[6].msg.Headers}

	res, err := ix.resolve(ctx, batch)
	require.NoError(t, err)
	require.Equal(t, 9, res.Indexed)
	require.Equal(t, 1, res.Dead)
	dl := f.deadLetters(1)
	require.Equal(t, long, string(dl[0].Key))
	h := headerMap(dl[0])
	require.Equal(t, "400", h[HeaderDLQStatus])
	require.Equal(t, "action_request_validation_exception", h[HeaderDLQCode])
	require.Len(t, f.search(f.cfg.Alias), 9)
}

// A proxy (or a setting) in front of the engine that refuses every bulk
// request with 400 is no document's fault. With a batch of one document,
// as a quiet topic gives, bisection has no second document to tell the two
// apart: the document must not be dead-lettered (and its offset committed)
// for an answer that is not the engine's. The engine's own 400 for a lone
// item is still dead-lettered.
func TestBisectLoneDocumentProxy400NotDeadLettered(t *testing.T) {
	t.Parallel()
	real := stack.ElasticsearchURL(t)
	fi := newFaultInjector(t, real)
	f := newFixture(t, fi.URL(), real, 1)
	ix, err := New(f.cfg)
	require.NoError(t, err)
	ctx := context.Background()
	_, err = index.Ensure(ctx, ix.client, ix.cfg.Alias, ix.cfg.WriteAlias, ix.cfg.Mapping)
	require.NoError(t, err)
	require.NoError(t, ensureTopic(ctx, ix.cfg.Brokers, ix.cfg.DeadLetterTopic, 1))
	defer ix.dlq.Close()

	fi.refuseAllPlainText(http.StatusBadRequest)
	good := ix.rules.parse(upsert("good", 1, docN(1)).message())
	require.Nil(t, good.poison)
	res, err := ix.resolve(ctx, []*doc{good})
	require.Error(t, err, "a proxy's 400 is returned, not dead-lettered")
	var ee *elastic.Error
	require.ErrorAs(t, err, &ee)
	require.Equal(t, http.StatusBadRequest, ee.Status)
	require.Zero(t, res.Dead)

	fi.refuseAllPlainText(0)
	fi.refuseRequestsHolding("bad", http.StatusBadRequest)
	bad := ix.rules.parse(upsert("bad", 1, docN(2)).message())
	res, err = ix.resolve(ctx, []*doc{bad})
	require.NoError(t, err)
	require.Equal(t, 1, res.Dead)
	dl := f.deadLetters(1)
	require.Equal(t, "bad", string(dl[0].Key), "only the engine-refused document is dead-lettered")
}
