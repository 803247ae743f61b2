package sink

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/olivere/elastic/v7"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

func TestMain(m *testing.M) { stack.Main(m) }

// rec is one outbox record as the publisher writes it.
type rec struct {
	id      string
	version int64
	typ     string // upsert (default) or delete
	doc     string // JSON, upserts only
	headers map[string]string
	// partition is Message.Partition, for a writer whose balancer honours it.
	partition int
}

func upsert(id string, v int64, doc string) rec { return rec{id: id, version: v, doc: doc} }
func del(id string, v int64) rec                { return rec{id: id, version: v, typ: "delete"} }

func (r rec) message() kafka.Message {
	typ := r.typ
	if typ == "" {
		typ = "upsert"
	}
	m := kafka.Message{Key: []byte(r.id), Partition: r.partition, Headers: []kafka.Header{
		{Key: outbox.HeaderSpecVersion, Value: []byte(outbox.SpecVersion)},
		{Key: outbox.HeaderID, Value: []byte(fmt.Sprintf("%s-%d", r.id, r.version))},
		{Key: outbox.HeaderType, Value: []byte(outbox.TypePrefix + typ)},
		{Key: outbox.HeaderSubject, Value: []byte(r.id)},
		{Key: outbox.HeaderAggregateVersion, Value: []byte(strconv.FormatInt(r.version, 10))},
	}}
	for k, v := range r.headers {
		m.Headers = append(m.Headers, kafka.Header{Key: k, Value: []byte(v)})
	}
	if typ == "upsert" {
		m.Value = []byte(r.doc)
	}
	return m
}

// fixture is one test's topic, group, aliases and clients.
type fixture struct {
	t       testing.TB
	cfg     Config
	client  *elastic.Client // straight to the engine (never the injector)
	writer  *kafka.Writer
	kclient *kafka.Client
}

// newFixture makes a fresh topic with partitions and a config that points
// at engineURL (the real engine or an injector in front of it). With
// partitions 0 the topic is named but not created.
func newFixture(t testing.TB, engineURL, realURL string, partitions int) *fixture {
	t.Helper()
	brokers := stack.KafkaBrokers(t)
	topic := stack.UniqueName("sink")
	ctx := context.Background()
	kc := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 10 * time.Second}
	if partitions > 0 {
		require.NoError(t, ensureTopic(ctx, brokers, topic, partitions))
		eventually(t, 30*time.Second, func() error { // leaders are elected a moment after creation
			_, err := topicOffsets(ctx, kc, topic, "none")
			return err
		})
	}
	client, err := index.NewClient(realURL)
	require.NoError(t, err)
	w := &kafka.Writer{Addr: kafka.TCP(brokers...), Topic: topic, Balancer: &kafka.Hash{}, RequiredAcks: kafka.RequireAll, BatchTimeout: 2 * time.Millisecond}
	t.Cleanup(func() { _ = w.Close() })
	alias := stack.UniqueName("records")
	f := &fixture{t: t, client: client, writer: w, kclient: kc, cfg: Config{
		Brokers:           brokers,
		Topic:             topic,
		Group:             stack.UniqueName("group"),
		URL:               engineURL,
		Alias:             alias,
		Mapping:           []byte(`{"settings":{"number_of_shards":1,"number_of_replicas":0,"index.gc_deletes":"1s","refresh_interval":"1s"},"mappings":{"properties":{"_deleted":{"type":"boolean"},"n":{"type":"integer"},"extra":{"type":"object","dynamic":"strict"}}}}`),
		BatchSize:         100,
		FlushInterval:     20 * time.Millisecond,
		RetryInitial:      20 * time.Millisecond,
		RetryMax:          500 * time.Millisecond,
		RetryMaxElapsed:   2 * time.Minute,
		SessionTimeout:    6 * time.Second,
		HeartbeatInterval: time.Second,
		Logger:            slog.New(slog.NewTextHandler(io.Discard, nil)),
	}}
	if testing.Verbose() {
		f.cfg.Logger = slog.New(slog.NewTextHandler(&testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	t.Cleanup(func() {
		// Best effort: keep the shared node small.
		for _, idx := range []string{alias + "_v1", alias + "_v2"} {
			_, _ = client.PerformRequest(context.Background(), elastic.PerformRequestOptions{Method: http.MethodDelete, Path: "/" + idx, IgnoreErrors: []int{404}})
		}
	})
	return f
}

type testWriter struct{ t testing.TB }

func (w *testWriter) Write(b []byte) (int, error) {
	w.t.Log(string(bytes.TrimSpace(b)))
	return len(b), nil
}

func (f *fixture) produce(recs ...rec) {
	f.t.Helper()
	msgs := make([]kafka.Message, len(recs))
	for i, r := range recs {
		msgs[i] = r.message()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(f.t, f.writer.WriteMessages(ctx, msgs...))
}

// start runs an indexer with cfg until the test ends.
func (f *fixture) start(cfg Config) *Indexer {
	f.t.Helper()
	ix, err := New(cfg)
	require.NoError(f.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ix.Run(ctx) }()
	f.t.Cleanup(func() {
		cancel()
		require.NoError(f.t, <-done)
	})
	return ix
}

// offsets returns the group's view of the topic.
func (f *fixture) offsets(group string) []PartitionOffsets {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	po, err := topicOffsets(ctx, f.kclient, f.cfg.Topic, group)
	require.NoError(f.t, err)
	return po
}

// waitCaughtUp waits until group has committed the end of every partition.
func (f *fixture) waitCaughtUp(group string, timeout time.Duration) {
	f.t.Helper()
	eventually(f.t, timeout, func() error {
		for _, p := range f.offsets(group) {
			if p.Lag() != 0 {
				return fmt.Errorf("partition %d: committed %d, end %d", p.Partition, p.Committed, p.End)
			}
		}
		return nil
	})
}

// eventually polls cond until it returns nil or timeout passes.
func eventually(t testing.TB, timeout time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("condition not met after %s: %v", timeout, err)
		}
		<-tick.C
	}
}

type storedDoc struct {
	Found   bool            `json:"found"`
	Version int64           `json:"_version"`
	Source  json.RawMessage `json:"_source"`
}

// get reads a document by id through the read alias (GET ignores the
// alias filter, so tombstones are visible here).
func (f *fixture) get(id string) storedDoc {
	f.t.Helper()
	res, err := f.client.PerformRequest(context.Background(), elastic.PerformRequestOptions{
		Method: http.MethodGet, Path: "/" + f.cfg.Alias + "/_doc/" + url.PathEscape(id), IgnoreErrors: []int{404},
	})
	require.NoError(f.t, err)
	var d storedDoc
	require.NoError(f.t, json.Unmarshal(res.Body, &d))
	if d.Found {
		d.Source = stripReconcileFields(f.t, id, d.Version, d.Source)
	}
	return d
}

// stripReconcileFields checks the fields the indexer adds for package
// reconcile and returns the document without them, as the user wrote it.
// Documents the test wrote directly into the engine come back unchanged.
func stripReconcileFields(t testing.TB, id string, version int64, src json.RawMessage) json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(src, &m))
	if _, byIndexer := m[FieldBucket]; !byIndexer {
		return src // written by the test itself, not through the indexer
	}
	deleted := string(m[FieldDeleted]) == "true"
	require.Equal(t, strconv.Itoa(Bucket(id)), string(m[FieldBucket]), "%s of %s", FieldBucket, id)
	var pv string
	if raw, ok := m[FieldPV]; ok {
		require.NoError(t, json.Unmarshal(raw, &pv))
	}
	require.Equal(t, strconv.FormatInt(IDV(id, version, deleted, pv), 10), string(m[FieldIDV]), "%s of %s", FieldIDV, id)
	if deleted {
		var at int64
		require.NoError(t, json.Unmarshal(m[FieldDeletedAt], &at), "%s of %s", FieldDeletedAt, id)
		require.Positive(t, at, "%s of %s", FieldDeletedAt, id)
	}
	delete(m, FieldDeletedAt)
	delete(m, FieldBucket)
	delete(m, FieldIDV)
	delete(m, FieldPV)
	delete(m, FieldPosition) // NullValues "delete" only; checked by the tests that need it
	delete(m, FieldAggregateType)
	out, err := json.Marshal(m)
	require.NoError(t, err)
	return out
}

// search returns id → source of every document a user sees through alias.
func (f *fixture) search(alias string) map[string]string {
	f.t.Helper()
	ctx := context.Background()
	_, err := f.client.PerformRequest(ctx, elastic.PerformRequestOptions{Method: http.MethodPost, Path: "/" + alias + "/_refresh"})
	require.NoError(f.t, err)
	res, err := f.client.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method: http.MethodPost, Path: "/" + alias + "/_search",
		Body: map[string]any{"size": 10000, "query": map[string]any{"match_all": map[string]any{}}, "version": true},
	})
	require.NoError(f.t, err)
	var sr struct {
		Hits struct {
			Hits []struct {
				ID      string          `json:"_id"`
				Version int64           `json:"_version"`
				Source  json.RawMessage `json:"_source"`
			} `json:"hits"`
		} `json:"hits"`
	}
	require.NoError(f.t, json.Unmarshal(res.Body, &sr))
	out := map[string]string{}
	for _, h := range sr.Hits.Hits {
		out[h.ID] = fmt.Sprintf("v%d %s", h.Version, stripReconcileFields(f.t, h.ID, h.Version, h.Source))
	}
	return out
}

// deadLetters reads every message of the dead-letter topic.
func (f *fixture) deadLetters(want int) []kafka.Message {
	f.t.Helper()
	dlq := f.cfg.withDefaults().DeadLetterTopic
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: f.cfg.Brokers, Topic: dlq, Partition: 0, MaxWait: 100 * time.Millisecond})
	defer r.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out []kafka.Message
	for len(out) < want {
		m, err := r.FetchMessage(ctx)
		require.NoError(f.t, err, "dead letters so far: %d, want %d", len(out), want)
		out = append(out, m)
	}
	return out
}

func headerMap(m kafka.Message) map[string]string {
	out := map[string]string{}
	for _, h := range m.Headers {
		out[h.Key] = string(h.Value)
	}
	return out
}

// ensureTopic is ensureTopicVia over a plaintext connection, for tests on
// the stack's plaintext broker. Code that runs against a user's cluster
// passes Config.kafkaTransport, so it has no plaintext shortcut to reach for.
func ensureTopic(ctx context.Context, brokers []string, topic string, partitions int, configs ...kafka.ConfigEntry) error {
	return ensureTopicVia(ctx, kafka.DefaultTransport, brokers, topic, partitions, configs...)
}
