package sink

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/outbox"
	"github.com/outboxrelay/outboxrelay/reconcile"
)

func TestParse(t *testing.T) {
	t.Parallel()
	withHeader := func(m kafka.Message, k, v string) kafka.Message {
		m.Headers = append(m.Headers, kafka.Header{Key: k, Value: []byte(v)})
		return m
	}
	tests := []struct {
		name     string
		msg      kafka.Message
		wantCode string
		wantOp   op
		wantBody string
		wantVer  int64
	}{
		{name: "upsert", msg: upsert("a", 3, `{"x":1}`).message(), wantOp: opUpsert, wantBody: `{"x":1}`, wantVer: 3},
		{name: "delete becomes a tombstone document", msg: del("a", 7).message(), wantOp: opDelete, wantBody: `{"_deleted":true}`, wantVer: 7},
		{name: "pretty JSON is compacted for NDJSON", msg: upsert("a", 1, "{\n  \"x\": 1\n}").message(), wantBody: `{"x":1}`, wantVer: 1},
		{name: "last version header wins", msg: withHeader(upsert("a", 1, `{}`).message(), outbox.HeaderAggregateVersion, "9"), wantBody: `{}`, wantVer: 9},
		{name: "no key", msg: upsert("", 1, `{}`).message(), wantCode: CodeMissingKey},
		{name: "bad version", msg: withHeader(upsert("a", 1, `{}`).message(), outbox.HeaderAggregateVersion, "x"), wantCode: CodeBadVersion},
		{name: "negative version", msg: withHeader(upsert("a", 1, `{}`).message(), outbox.HeaderAggregateVersion, "-1"), wantCode: CodeBadVersion},
		{name: "unknown type", msg: rec{id: "a", version: 1, typ: "merge"}.message(), wantCode: CodeUnknownType},
		{name: "upsert without value", msg: func() kafka.Message { m := upsert("a", 1, "").message(); m.Value = nil; return m }(), wantCode: CodeMissingDocument},
		{name: "array document", msg: upsert("a", 1, `[1]`).message(), wantCode: CodeInvalidJSON},
		{name: "broken JSON", msg: upsert("a", 1, `{"x":`).message(), wantCode: CodeInvalidJSON},
		{name: "too large", msg: upsert("a", 1, `{"x":"`+strings.Repeat("y", 100)+`"}`).message(), wantCode: CodeDocumentTooLarge},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			d := parse(tt.msg, 100)
			if tt.wantCode != "" {
				require.NotNil(t, d.poison)
				require.Equal(t, tt.wantCode, d.poison.Code)
				return
			}
			require.Nil(t, d.poison)
			require.Equal(t, tt.wantOp, d.op)
			require.Equal(t, tt.wantBody, string(d.body))
			require.Equal(t, string(appendReconcileFields(nil, []byte(tt.wantBody), reconcile.Bucket("a"), reconcile.IDV("a", tt.wantVer, tt.wantOp == opDelete, ""), "")), string(appendDocument(nil, d)))
			require.Equal(t, tt.wantVer, d.version)
		})
	}
}

func TestAppendReconcileFields(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, in, want string }{
		{"empty object", `{}`, `{"_bucket":%d,"_idv":%d}`},
		{"object", `{"x":1}`, `{"x":1,"_bucket":%d,"_idv":%d}`},
		{"spaces inside", `{ }`, `{ "_bucket":%d,"_idv":%d}`},
	} {
		want := fmt.Sprintf(tc.want, reconcile.Bucket("42"), reconcile.IDV("42", 3, false, ""))
		bucket, idv := reconcile.Bucket("42"), reconcile.IDV("42", 3, false, "")
		got := appendReconcileFields(nil, []byte(tc.in), bucket, idv, "")
		require.Equal(t, want, string(got), tc.name)
		require.True(t, json.Valid(got), tc.name)
		// Appended after other bytes (the bulk body so far).
		got = appendReconcileFields([]byte("{\"index\":{}}\n"), []byte(tc.in), bucket, idv, "")
		require.Equal(t, "{\"index\":{}}\n"+want, string(got), tc.name)
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	ok := Config{Brokers: []string{"k:9092"}, URL: "http://e:9200"}
	tests := []struct {
		name   string
		mutate func(*Config)
		want   string
	}{
		{name: "defaults are valid", mutate: func(*Config) {}},
		{name: "no brokers", mutate: func(c *Config) { c.Brokers = nil }, want: "KAFKA_BROKERS is required"},
		{name: "no url", mutate: func(c *Config) { c.URL = "" }, want: "ELASTICSEARCH_URL is required"},
		{name: "same aliases", mutate: func(c *Config) { c.WriteAlias = "records" }, want: `WRITE_ALIAS="records"`},
		{name: "negative rate", mutate: func(c *Config) { c.MaxRate = -1 }, want: "MAX_RATE=-1"},
		{name: "short session", mutate: func(c *Config) { c.SessionTimeout = time.Second }, want: "SESSION_TIMEOUT=1s"},
		{name: "lanes", mutate: func(c *Config) { c.Lanes = 1000 }, want: "LANES=1000"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := ok
			tt.mutate(&c)
			_, err := New(c)
			if tt.want == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tt.want)
		})
	}
}

func TestThrottleAIMD(t *testing.T) {
	t.Parallel()
	var reported []float64
	th := newThrottle(0, 100, func(l float64) { reported = append(reported, l) })
	require.Zero(t, th.limit(), "unlimited by default")
	th.overloaded(1000)
	require.Equal(t, 500.0, th.limit(), "halved from the observed throughput")
	th.overloaded(2000)
	require.Equal(t, 250.0, th.limit(), "halved again from the current limit")
	th.healthy(250)
	require.InDelta(t, 312.5, th.limit(), 0.01)
	for range 20 {
		th.healthy(300)
	}
	require.Zero(t, th.limit(), "back to unlimited once the limit no longer binds")
	require.Equal(t, 0.0, reported[len(reported)-1])

	capped := newThrottle(200, 50, nil)
	capped.overloaded(10)
	require.Equal(t, float64(throttleFloor), capped.limit(), "never below the floor")
	for range 30 {
		capped.healthy(1e6)
	}
	require.Equal(t, 200.0, capped.limit(), "recovers to the configured cap, not above")
}
