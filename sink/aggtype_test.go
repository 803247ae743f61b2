package sink

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/outbox"
)

// The indexed document says whose it is (reconcile compares and repairs
// only its own aggregate type's documents).
func TestDocumentCarriesAggregateType(t *testing.T) {
	t.Parallel()
	for _, typ := range []string{"source_records", `odd "type"\`} {
		r := upsert("a", 2, `{"x":1}`)
		r.headers = map[string]string{outbox.HeaderAggregateType: typ}
		d := parse(r.message(), 100)
		require.Nil(t, d.poison)
		var m map[string]any
		require.NoError(t, json.Unmarshal(appendDocument(nil, d), &m))
		require.Equal(t, typ, m[FieldAggregateType])
		require.EqualValues(t, 1, m["x"])
		require.EqualValues(t, Bucket("a"), m[FieldBucket])
	}
	d := parse(upsert("a", 2, `{}`).message(), 100)
	require.Equal(t, string(appendReconcileFields(nil, []byte(`{}`), d.bucket, d.idv, d.pv)), string(appendDocument(nil, d)), "no header, no field")
}
