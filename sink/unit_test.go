package sink

import (
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/outbox"
)

// parse parses with the default rules and a document limit.
func parse(m kafka.Message, maxDocBytes int) *doc {
	return newRecordRules(Config{MaxDocumentBytes: maxDocBytes}.withDefaults()).parse(m)
}

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
		wantID   string // default "a"
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
		{name: "id too long for the engine", msg: upsert(strings.Repeat("é", MaxIDBytes/2+1), 1, `{}`).message(), wantCode: CodeIDTooLong},
		{name: "key not UTF-8", msg: upsert("\xff1", 1, `{}`).message(), wantCode: CodeInvalidKey},
		{name: "id at the engine's limit", msg: upsert(strings.Repeat("k", MaxIDBytes), 1, `{}`).message(), wantBody: `{}`, wantVer: 1, wantID: strings.Repeat("k", MaxIDBytes)},
		{name: "reserved tombstone field", msg: upsert("a", 1, `{"n":1,"_deleted":true}`).message(), wantCode: CodeReservedField},
		{name: "reserved reconcile field", msg: upsert("a", 1, `{"_bucket":3}`).message(), wantCode: CodeReservedField},
		{name: "engine metadata field", msg: upsert("a", 1, `{"_id":"b"}`).message(), wantCode: CodeReservedField},
		{name: "escaped reserved field", msg: upsert("a", 1, `{"\u005fdeleted":true}`).message(), wantCode: CodeReservedField},
		{name: "nested underscore fields are the user's", msg: upsert("a", 1, `{"x":{"_deleted":true},"_private":1}`).message(), wantBody: `{"x":{"_deleted":true},"_private":1}`, wantVer: 1},
		{name: "too large", msg: upsert("a", 1, `{"x":"`+strings.Repeat("y", 1000)+`"}`).message(), wantCode: CodeDocumentTooLarge},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			d := parse(tt.msg, 1000)
			if tt.wantCode != "" {
				require.NotNil(t, d.poison)
				require.Equal(t, tt.wantCode, d.poison.Code)
				return
			}
			require.Nil(t, d.poison)
			require.Equal(t, tt.wantOp, d.op)
			require.Equal(t, tt.wantBody, string(d.body))
			id := cmp.Or(tt.wantID, "a")
			require.Equal(t, id, d.id)
			want := string(appendReconcileFields(nil, []byte(tt.wantBody), Bucket(id), IDV(id, tt.wantVer, tt.wantOp == opDelete, ""), ""))
			if tt.wantOp == opDelete { // a tombstone says when it was written
				require.Positive(t, d.deletedAt)
				want = want[:len(want)-1] + `,"` + FieldDeletedAt + `":` + strconv.FormatInt(d.deletedAt, 10) + "}"
			}
			require.Equal(t, want, string(appendDocument(nil, d)))
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
		want := fmt.Sprintf(tc.want, Bucket("42"), IDV("42", 3, false, ""))
		bucket, idv := Bucket("42"), IDV("42", 3, false, "")
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
		{name: "dead letters smaller than documents", mutate: func(c *Config) { c.DeadLetterMaxBytes = 2 << 20 }, want: "DEAD_LETTER_MAX_BYTES=2097152"},
		{name: "skipping the pipeline's own type", mutate: func(c *Config) { c.SkipEventTypes = []string{"outboxrelay.delete"} }, want: `SKIP_EVENT_TYPES: "outboxrelay.delete"`},
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

// The settings for other producers' records, and routing.
func TestParseRules(t *testing.T) {
	t.Parallel()
	typed := func(r rec, aggType string) kafka.Message {
		m := r.message()
		m.Headers = append(m.Headers, kafka.Header{Key: outbox.HeaderAggregateType, Value: []byte(aggType)})
		return m
	}
	event := func(typ string) kafka.Message { // another producer's application event, through outbox.Enqueue
		m := upsert("a", 1, `{}`).message()
		for i, h := range m.Headers {
			if h.Key == outbox.HeaderType {
				m.Headers[i].Value = []byte(typ)
			}
		}
		return m
	}
	foreignTombstone := kafka.Message{Key: []byte("a")}
	versionedTombstone := kafka.Message{Key: []byte("a"), Headers: []kafka.Header{{Key: outbox.HeaderAggregateVersion, Value: []byte("5")}}}
	nullUpsert := upsert("a", 2, "").message()
	nullUpsert.Value = nil
	tests := []struct {
		name       string
		cfg        Config
		msg        kafka.Message
		wantCode   string
		wantSkip   string
		wantID     string
		wantTarget string
		wantOp     op
		wantVer    int64
		fromIndex  bool
	}{
		{name: "other event type dead-lettered by default", msg: event("shop.order_shipped"), wantCode: CodeUnknownType},
		{name: "listed event type skipped", cfg: Config{SkipEventTypes: []string{"shop.order_shipped"}}, msg: event("shop.order_shipped"), wantSkip: SkipEventType},
		{name: "unlisted event type still dead-lettered", cfg: Config{SkipEventTypes: []string{"shop.order_shipped"}}, msg: event("shop.order_paid"), wantCode: CodeUnknownType},
		{name: "star skips every other event type", cfg: Config{SkipEventTypes: []string{"*"}}, msg: event("shop.order_paid"), wantSkip: SkipEventType},
		{name: "star skips a foreign record without headers", cfg: Config{SkipEventTypes: []string{"*"}}, msg: kafka.Message{Key: []byte("a"), Value: []byte(`{"x":1}`)}, wantSkip: SkipEventType},
		{name: "star leaves a foreign null value to NULL_VALUES", cfg: Config{SkipEventTypes: []string{"*"}, NullValues: NullValuesIgnore}, msg: foreignTombstone, wantSkip: SkipNullValue},
		{name: "star skips a keyless foreign record", cfg: Config{SkipEventTypes: []string{"*"}}, msg: kafka.Message{Value: []byte(`{"x":1}`)}, wantSkip: SkipEventType},
		{name: "keyless record of a type not indexed skipped", cfg: Config{AggregateTypes: []string{"records"}}, msg: typed(upsert("", 1, `{}`), "invoices"), wantSkip: SkipAggregateType},
		{name: "keyless upsert still missing_key", cfg: Config{SkipEventTypes: []string{"*"}}, msg: upsert("", 1, `{}`).message(), wantCode: CodeMissingKey},
		{name: "star keeps upserts", cfg: Config{SkipEventTypes: []string{"*"}}, msg: upsert("a", 1, `{}`).message(), wantID: "a", wantTarget: "records-write", wantVer: 1},
		{name: "aggregate type not indexed", cfg: Config{AggregateTypes: []string{"records"}}, msg: typed(upsert("a", 1, `{}`), "invoices"), wantSkip: SkipAggregateType},
		{name: "aggregate type indexed", cfg: Config{AggregateTypes: []string{"records"}}, msg: typed(upsert("a", 1, `{}`), "records"), wantID: "a", wantTarget: "records-write", wantVer: 1},
		{name: "foreign tombstone fails by default", msg: foreignTombstone, wantCode: CodeNullValue},
		{name: "foreign tombstone ignored", cfg: Config{NullValues: NullValuesIgnore}, msg: foreignTombstone, wantSkip: SkipNullValue},
		{name: "foreign tombstone deletes at the index's version", cfg: Config{NullValues: NullValuesDelete}, msg: foreignTombstone, wantID: "a", wantTarget: "records-write", wantOp: opDelete, fromIndex: true},
		{name: "versioned tombstone deletes at its version", cfg: Config{NullValues: NullValuesDelete}, msg: versionedTombstone, wantID: "a", wantTarget: "records-write", wantOp: opDelete, wantVer: 5},
		{name: "upsert without value still missing_document", msg: nullUpsert, wantCode: CodeMissingDocument},
		{name: "upsert without value deletes with NULL_VALUES=delete", cfg: Config{NullValues: NullValuesDelete}, msg: nullUpsert, wantID: "a", wantTarget: "records-write", wantOp: opDelete, wantVer: 2},
		{name: "routed by aggregate type", cfg: Config{Routes: map[string]string{"orders": "orders_idx"}}, msg: typed(upsert("a", 1, `{}`), "orders"), wantID: "a", wantTarget: "orders_idx-write", wantVer: 1},
		{name: "unrouted type to the default alias", cfg: Config{Routes: map[string]string{"orders": "orders_idx"}}, msg: typed(upsert("a", 1, `{}`), "users"), wantID: "a", wantTarget: "records-write", wantVer: 1},
		{name: "typed id", cfg: Config{IDFormat: IDFormatTypeID}, msg: typed(upsert("a", 1, `{}`), "orders"), wantID: "orders:a", wantTarget: "records-write", wantVer: 1},
		{name: "typed id needs the type", cfg: Config{IDFormat: IDFormatTypeID}, msg: upsert("a", 1, `{}`).message(), wantCode: CodeMissingAggregateType},
		{name: "_pos is the user's by default", msg: upsert("a", 1, `{"_pos":1}`).message(), wantID: "a", wantTarget: "records-write", wantVer: 1},
		{name: "_pos reserved with NULL_VALUES=delete", cfg: Config{NullValues: NullValuesDelete}, msg: upsert("a", 1, `{"_pos":1}`).message(), wantCode: CodeReservedField},
		{name: "_pos does not hide a later reserved field", msg: upsert("a", 1, `{"_pos":1,"_deleted":true}`).message(), wantCode: CodeReservedField},
		{name: "typed id length checked", cfg: Config{IDFormat: IDFormatTypeID}, msg: typed(upsert(strings.Repeat("k", MaxIDBytes-3), 1, `{}`), "orders"), wantCode: CodeIDTooLong},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			d := newRecordRules(tt.cfg.withDefaults()).parse(tt.msg)
			if tt.wantCode != "" {
				require.NotNil(t, d.poison)
				require.Equal(t, tt.wantCode, d.poison.Code)
				return
			}
			require.Nil(t, d.poison)
			require.Equal(t, tt.wantSkip, d.skip)
			if tt.wantSkip != "" {
				return
			}
			require.Equal(t, tt.wantID, d.id)
			require.Equal(t, tt.wantTarget, d.target)
			require.Equal(t, tt.wantOp, d.op)
			require.Equal(t, tt.wantVer, d.version)
			require.Equal(t, tt.fromIndex, d.versionFromIndex)
		})
	}
}

// TestBulkBodySizeCoversTheBody: sendBulk allocates each body once, at
// bulkBodySize; a body that outgrew it would be copied while it is built.
func TestBulkBodySizeCoversTheBody(t *testing.T) {
	t.Parallel()
	withHeaders := func(r rec) rec {
		r.headers = map[string]string{outbox.HeaderProcessorVersion: "v2026-12-normalizer", outbox.HeaderAggregateType: "source_records"}
		return r
	}
	cases := map[string]kafka.Message{
		"upsert":                              upsert("7266", 3, `{"id":7266,"title":"Record 2422 about search","tags":["t2","t0"]}`).message(),
		"empty document":                      upsert("a", 1, `{}`).message(),
		"upsert with processor version, type": withHeaders(upsert("12345678", 1<<40, `{"x":1}`)).message(),
		"delete":                              withHeaders(del(strings.Repeat("k", 100), 1<<62)).message(),
	}
	for name, m := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			d := parse(m, 1<<20)
			require.Nil(t, d.poison)
			d.target = "records-catalogue_v2026-12-normalizer-write"
			d.withPosition = true
			m.Partition, m.Offset = 1<<30, 1<<62
			d.msg = m
			d.versionFromIndex = true // external_gte
			var buf bytes.Buffer
			appendBulk(&buf, d)
			require.GreaterOrEqual(t, bulkBodySize([]*doc{d}), buf.Len(), "%s", buf.String())
		})
	}
}
