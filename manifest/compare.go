package manifest

import (
	"cmp"
	"encoding/json"
	"fmt"
)

// rowState is what a target row holds for one item, or what it should hold.
type rowState struct {
	found    bool
	tenant   string
	revision int64
	status   string
	fields   map[string]json.RawMessage
}

// compareRow names each way got differs from want. It is the one comparison
// of "approved vs found": a chunk's conflict compares the approval with the
// row it found, the report compares what the chunk left with the row now.
// badFields are the match fields the database found unequal (compared as
// typed values, see targetSQL); wantWord and gotWord label the two sides.
func compareRow(want, got rowState, badFields []string, wantWord, gotWord string) []string {
	if !got.found {
		return []string{"missing (no row with this id)"}
	}
	var diffs []string
	if got.tenant != want.tenant {
		diffs = append(diffs, fmt.Sprintf("tenant: %s %q, %s %q", wantWord, want.tenant, gotWord, got.tenant))
	}
	if got.revision != want.revision {
		diffs = append(diffs, fmt.Sprintf("revision: %s %d, %s %d", wantWord, want.revision, gotWord, got.revision))
	}
	if got.status != want.status {
		diffs = append(diffs, fmt.Sprintf("status: %s %q, %s %q", wantWord, want.status, gotWord, got.status))
	}
	for _, k := range badFields {
		diffs = append(diffs, fmt.Sprintf("%s: %s %s, %s %s", k, wantWord, want.fields[k], gotWord, cmp.Or(string(got.fields[k]), "null")))
	}
	return diffs
}
