package outbox_test

import (
	"context"
	"math/rand/v2"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

func publisherEnv(dbURL string, brokers []string) []string {
	return []string{
		"DATABASE_URL=" + dbURL, "KAFKA_BROKERS=" + strings.Join(brokers, ","), "METRICS_ADDR=",
		"LEASE_TTL=2s", "POLL_INTERVAL=200ms", "LOG_FORMAT=json", "LOG_LEVEL=warn", "SHUTDOWN_GRACE=20s",
	}
}

// Three publisher processes share 100,000 events over 1,000 keys: every event
// arrives, per-key order holds, duplicates are counted, the outbox is empty.
func TestPublishThreeProcesses(t *testing.T) {
	t.Parallel()
	const events, keys = 100_000, 1_000
	bin := testproc.Build(t, "publisher")
	brokers := stack.KafkaBrokers(t)
	dbURL := stack.Database(t)
	pool := stack.Pool(t, dbURL)
	topic := createTopic(t, brokers, 6)
	insertEvents(t, pool, topic, keys, 0, events, 40)

	env := publisherEnv(dbURL, brokers)
	var procs []*testproc.Proc
	for range 3 {
		procs = append(procs, testproc.Start(t, bin, env, "run"))
	}
	start := time.Now()
	waitFor(t, 4*time.Minute, "the outbox to drain", func() bool { return outboxCount(t, pool) == 0 })
	t.Logf("3 publishers drained %d events in %s", events, time.Since(start).Round(time.Millisecond))

	// Each publisher held shards: the work was shared.
	waitFor(t, time.Minute, "the shards to spread over 3 publishers", func() bool {
		var owners, shards int
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(DISTINCT owner), count(owner) FROM outbox_shard_leases`).Scan(&owners, &shards))
		return owners == 3 && shards == 64
	})

	for _, p := range procs {
		require.NoError(t, p.Signal(syscall.SIGTERM))
	}
	for _, p := range procs {
		require.NoError(t, p.Wait(time.Minute), p.Stderr())
		require.Equal(t, 0, p.ExitCode(), p.Stderr())
	}
	var leased int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_shard_leases WHERE owner IS NOT NULL`).Scan(&leased))
	require.Zero(t, leased, "a clean stop releases every lease")

	msgs := consumeAll(t, brokers, topic, wantIDs(topic, keys, 0, events), 2*time.Minute)
	dups := checkOrder(t, msgs)
	t.Logf("consumer: %s", fmtDup(dups, len(msgs)))
	require.Zero(t, outboxCount(t, pool), "the outbox holds nothing once published")
}

// chaosSeedEnv replays TestPublishChaos's choice of victims and pauses.
const chaosSeedEnv = "OUTBOXRELAY_CHAOS_SEED"

// Chaos: events are written while a random publisher is SIGKILLed every
// ~2 s and restarted. Nothing is lost and per-key order holds. The victims
// and pauses come from a seed the test prints (replay: chaosSeedEnv).
func TestPublishChaos(t *testing.T) {
	t.Parallel()
	const keys, chunk, chunks = 500, 1_000, 40
	seed := testproc.Seed(t, chaosSeedEnv)
	rng := rand.New(rand.NewPCG(seed, 0))
	bin := testproc.Build(t, "publisher")
	brokers := stack.KafkaBrokers(t)
	dbURL := stack.Database(t)
	pool := stack.Pool(t, dbURL)
	topic := createTopic(t, brokers, 4)
	env := publisherEnv(dbURL, brokers)

	procs := make([]*testproc.Proc, 3)
	for i := range procs {
		procs[i] = testproc.Start(t, bin, env, "run")
	}
	writerDone := make(chan struct{})
	go func() {
		defer close(writerDone)
		for c := range chunks {
			insertEvents(t, pool, topic, keys, c*chunk, (c+1)*chunk, 40)
			time.Sleep(500 * time.Millisecond) // pacing the writer, not synchronising
		}
	}()
	kills := 0
	chaosEnd := time.After(25 * time.Second)
chaos:
	for {
		select {
		case <-chaosEnd:
			break chaos
		case <-time.After(time.Duration(1500+rng.IntN(1500)) * time.Millisecond):
		}
		i := rng.IntN(len(procs))
		require.NoError(t, procs[i].Signal(syscall.SIGKILL))
		_ = procs[i].Wait(10 * time.Second)
		require.True(t, procs[i].Killed())
		kills++
		procs[i] = testproc.Start(t, bin, env, "run")
	}
	<-writerDone
	waitFor(t, 3*time.Minute, "the outbox to drain after the chaos", func() bool { return outboxCount(t, pool) == 0 })
	msgs := consumeAll(t, brokers, topic, wantIDs(topic, keys, 0, chunk*chunks), 2*time.Minute)
	dups := checkOrder(t, msgs)
	t.Logf("%d kills; consumer: %s", kills, fmtDup(dups, len(msgs)))
	require.GreaterOrEqual(t, kills, 5)
}
