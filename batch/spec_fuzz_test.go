package batch_test

import (
	"encoding/json"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
)

// FuzzParseSpec feeds ParseSpec arbitrary YAML and JSON. It must never
// panic, and a spec it accepts must survive a round trip through JSON (what
// the batcher stores with a run) unchanged: same scope hash (the checkpoint
// guard) and same document hash (the processor-version guard). `make test`
// runs it for a fixed time (test-fuzz); a failing input is written to
// testdata/fuzz/FuzzParseSpec and replayed by plain `go test`.
func FuzzParseSpec(f *testing.F) {
	demo, err := os.ReadFile("../demo/job.yaml")
	require.NoError(f, err)
	f.Add(demo, false)
	full, err := json.Marshal(batch.DemoSpec())
	require.NoError(f, err)
	f.Add(full, true)
	for _, s := range []string{
		"job: j\nprocessor_version: v1\nsource: {table: t, version: v}\n",
		"job: j\nprocessor_version: v1\nmode: incremental\nvanished: keep\nsource: {table: t, version: v, cursor: [change_seq]}\n",
		"job: j\nprocessor_version: v1\nsource: {table: \"we\\\"ird\", version: v, filter: [{column: c, op: in, value: [1, 2]}]}\n",
		"job: j\nprocessor_version: v1\nsource: {table: t, version: v}\ndocument: {fields: [{name: title, from: payload.title, transforms: [trim, lower]}]}\n",
		"job: j\nprocessor_version: v1\nsource: {table: t, version: v}\nchunk: {size: 10, min: 5, max: 20, target_duration: 250ms}\n",
		`{"job":"j","processor_version":"v1","source":{"table":"t","version":"v"},"errors":{"policy":"quarantine","skip_ratio":0.5}}`,
	} {
		f.Add([]byte(s), s[0] == '{')
	}
	f.Fuzz(func(t *testing.T, b []byte, asJSON bool) {
		ext := ".yaml"
		if asJSON {
			ext = ".json"
		}
		s, err := batch.ParseSpec(b, ext)
		if err != nil {
			return
		}
		stored, err := json.Marshal(s)
		require.NoError(t, err)
		again, err := batch.ParseSpec(stored, ".json")
		require.NoError(t, err, "an accepted spec stored as JSON must parse again: %s", stored)
		require.Equal(t, s.Scope().Hash(), again.Scope().Hash(), "scope hash after a round trip of %s", stored)
		require.Equal(t, s.Document.Hash(), again.Document.Hash(), "document hash after a round trip of %s", stored)
		restored, err := json.Marshal(again)
		require.NoError(t, err)
		require.JSONEq(t, string(stored), string(restored))
	})
}
