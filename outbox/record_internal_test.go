package outbox

import (
	"encoding/json"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Values handed out by the arena stay intact while more are added, across
// chunk boundaries, and appending to one never writes into the next.
func TestArenaKeepsValues(t *testing.T) {
	var a arena
	var got [][]byte
	var want []string
	for i := range 5000 {
		v := strings.Repeat(strconv.Itoa(i), i%40+1)
		got = append(got, a.copy([]byte(v)))
		want = append(want, v)
		if i%7 == 0 {
			got = append(got, a.appendFunc(func(b []byte) []byte { return strconv.AppendInt(b, int64(i), 10) }))
			want = append(want, strconv.Itoa(i))
		}
	}
	_ = append(got[0], "overwrite?"...) // capacity ends at the length: a copy, not a write into got[1]
	for i := range got {
		require.Equal(t, want[i], string(got[i]), "value %d", i)
	}
	require.Nil(t, a.copy(nil), "nil stays nil (a delete's payload)")
	require.NotNil(t, a.copy([]byte{}), "empty stays empty, not nil")
}

// The builder's records carry the CloudEvents contract of record.go, and
// records built from one batch do not share header slices.
func TestRecordBuilder(t *testing.T) {
	created := time.Date(2026, 11, 30, 7, 0, 0, 123456000, time.UTC)
	rb := newRecordBuilder("outboxrelay", 2)
	upsert := storedEvent{id: 1, eventID: []byte("e-1"), topic: "t", aggregateType: "order", aggregateID: []byte("42"),
		aggregateVersion: 7, eventType: "upsert", payload: []byte(`{"a":1}`), headers: []byte(`{}`), createdAt: created}
	del := storedEvent{id: 2, eventID: []byte("e-2"), topic: "t", aggregateID: []byte("43"),
		aggregateVersion: 8, eventType: "delete", headers: []byte(`{"traceparent":"00-abc-def-01","ce_id":"spoof"}`), createdAt: created}
	m1, err := rb.record(&upsert)
	require.NoError(t, err)
	m2, err := rb.record(&del)
	require.NoError(t, err)

	got1 := map[string]string{}
	for _, h := range m1.Headers {
		got1[h.Key] = string(h.Value)
	}
	require.Equal(t, map[string]string{
		HeaderSpecVersion: "1.0", HeaderID: "e-1", HeaderSource: "outboxrelay", HeaderType: "outboxrelay.upsert",
		HeaderSubject: "42", HeaderTime: "2026-11-30T07:00:00.123456Z", HeaderAggregateVersion: "7",
		HeaderAggregateType: "order", HeaderContentType: "application/json",
	}, got1)
	require.Equal(t, "42", string(m1.Key))
	require.Equal(t, `{"a":1}`, string(m1.Value))

	var keys []string
	got2 := map[string]string{}
	for _, h := range m2.Headers {
		keys = append(keys, h.Key)
		got2[h.Key] = string(h.Value)
	}
	require.Nil(t, m2.Value, "a delete is a tombstone")
	require.Equal(t, "e-2", got2[HeaderID], "an event's own headers never replace the CloudEvents ones")
	require.Equal(t, "00-abc-def-01", got2[HeaderTraceParent])
	require.NotContains(t, got2, HeaderContentType)
	require.NotContains(t, got2, HeaderAggregateType)
	require.Equal(t, HeaderTraceParent, keys[len(keys)-1])

	m1.Headers = append(m1.Headers, m1.Headers[0]) // must not run into m2's headers
	require.Equal(t, HeaderSpecVersion, m2.Headers[0].Key)
	require.Equal(t, "e-2", string(m2.Headers[1].Value))

	_, err = rb.record(&storedEvent{eventID: []byte("e-3"), headers: []byte(`[1]`)})
	require.ErrorContains(t, err, "headers are not a JSON object of strings")
}

// After reset the arena hands out the same chunks again, from the start,
// without allocating, and the values it hands out then are intact.
func TestArenaReuse(t *testing.T) {
	var a arena
	fill := func(seed int) ([][]byte, []string) {
		var got [][]byte
		var want []string
		for i := range 3000 {
			v := strings.Repeat(strconv.Itoa(seed+i), i%50+1)
			got = append(got, a.copy([]byte(v)))
			want = append(want, v)
		}
		return got, want
	}
	fill(0)
	chunks := len(a.chunks)
	require.Greater(t, chunks, 1)
	a.reset()
	got, want := fill(7)
	require.Len(t, a.chunks, chunks, "no chunk added for as many values")
	for i := range got {
		require.Equal(t, want[i], string(got[i]), "value %d", i)
	}
	big := make([]byte, arenaChunk+1)
	require.Len(t, a.copy(big), arenaChunk+1, "a value larger than a chunk gets its own")
	require.Len(t, a.chunks, chunks, "and is not kept for reuse")

	v := []byte("0123456789")
	allocs := testing.AllocsPerRun(100, func() {
		a.reset()
		for range 3000 {
			a.copy(v)
		}
	})
	require.Zero(t, allocs)
}

// The batcher's headers (a flat jsonb object of plain strings) take the
// parser-free path; every form gives the headers encoding/json gives, in
// key order after the CloudEvents ones.
func TestEventHeadersFastPathMatchesJSON(t *testing.T) {
	for _, h := range []string{
		`{"ce_processorversion": "v2"}`,
		`{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "ce_processorversion": "v2"}`,
		`{"b":"2","a":"1"}`,
		` { "x" : "" } `,
		`{}`,
		`{"esc": "a\"b"}`,              // escapes: encoding/json
		`{"u": "\u00e9t\u00e9"}`,       // likewise
		`{"a": "1", "a": "2"}`,         // repeated key: encoding/json decides
		`{"ce_id": "spoof", "k": "v"}`, // never replaces a CloudEvents attribute
	} {
		e := storedEvent{eventID: []byte("e-1"), topic: "t", aggregateID: []byte("42"), eventType: "upsert", headers: []byte(h)}
		rb := newRecordBuilder("src", 1)
		got, err := rb.record(&e)
		require.NoError(t, err, h)
		var want map[string]string
		require.NoError(t, json.Unmarshal([]byte(h), &want), h)
		extra := got.Headers[7:] // after spec, id, source, type, subject, time, version (no payload, no aggregate type)
		keys := make([]string, 0, len(want))
		for k := range want {
			if k != HeaderID {
				keys = append(keys, k)
			}
		}
		slices.Sort(keys)
		require.Len(t, extra, len(keys), h)
		for i, k := range keys {
			require.Equal(t, k, extra[i].Key, h)
			require.Equal(t, want[k], string(extra[i].Value), h)
		}
		require.Equal(t, "e-1", string(got.Headers[1].Value), "%s: ce_id", h)
	}
	for _, bad := range []string{`[1]`, `{"a": 1}`, `{"a": "1"`, `{"a" "1"}`, `{"a": "1"} x`} {
		_, err := newRecordBuilder("src", 1).record(&storedEvent{eventID: []byte("e"), headers: []byte(bad)})
		require.Error(t, err, bad)
	}
	e := storedEvent{eventID: []byte("e-1"), topic: "t", aggregateID: []byte("42"), eventType: "upsert", headers: []byte(`{"ce_processorversion": "v2"}`)}
	rb := newRecordBuilder("src", 100)
	allocs := testing.AllocsPerRun(20, func() {
		rb.reset("src", 100)
		for range 100 {
			_, _ = rb.record(&e)
		}
	})
	// Per batch: the ce_type value and the header key, made once; nothing
	// per event (a JSON parse cost 11 allocations an event).
	require.LessOrEqual(t, allocs, 2.0, "allocations per batch of 100 events")
}

// A uuid read in binary is printed the way PostgreSQL prints it.
func TestAppendUUID(t *testing.T) {
	u := []byte{0x12, 0x3e, 0x45, 0x67, 0xe8, 0x9b, 0x12, 0xd3, 0xa4, 0x56, 0x42, 0x66, 0x14, 0x17, 0x40, 0xff}
	require.Equal(t, "123e4567-e89b-12d3-a456-4266141740ff", string(appendUUID([]byte("x"), u)[1:]))
}
