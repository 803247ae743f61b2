package manifest_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/manifest"
)

func TestParseRefusesMalformedFilesNamingTheItem(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		file string
		want string
	}{
		{"duplicate id", "duplicate_id.json", "items[2] (id 3): duplicate id, also items[0]"},
		{"missing revision", "missing_revision.json", `items[1] (id 2): "revision" is missing`},
		{"missing field", "missing_field.json", "items[1] (id 2): fields.qty is missing"},
		{"revision of the wrong type", "wrong_type.json", `items[1] (id 2): revision: want an integer >= 0, got "2"`},
		{"mixed id types", "mixed_ids.json", "items[1] (id b): id is a string but items[0] has a number id"},
		{"missing id", "missing_id.json", `items[1]: "id" is missing`},
		{"unknown key", "unknown_key.json", `items[0] (id 1): unknown key "qty"`},
		{"field not approved", "extra_field.json", "items[0] (id 1): fields.price is not in target.match_fields"},
		{"no chunk size", "no_chunk_size.json", "chunk_size=0: must be > 0"},
		{"match field is the status", "match_status.json", `target.match_fields: "status" is the status_column`},
		{"empty list", "empty.json", "items: the list is empty"},
		{"unknown top-level key", "typo.json", `unknown field "chunksize"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f, err := os.Open(filepath.Join("testdata", tc.file))
			require.NoError(t, err)
			defer f.Close()
			_, err = manifest.Parse(f)
			require.ErrorIs(t, err, manifest.ErrInvalid)
			require.Contains(t, err.Error(), tc.want)
		})
	}
}

func TestParseNormalizes(t *testing.T) {
	t.Parallel()
	f, err := os.Open(filepath.Join("testdata", "approved.json"))
	require.NoError(t, err)
	defer f.Close()
	spec, err := manifest.Parse(f)
	require.NoError(t, err)
	var ids []string
	for _, it := range spec.Items {
		ids = append(ids, it.ID)
	}
	require.Equal(t, []string{"2", "10", "15", "100"}, ids, "numeric ids sort as numbers")
	require.Equal(t, "number", spec.IDType)
	require.Equal(t, manifest.DefaultTopic, spec.Topic)
	require.Equal(t, "id", spec.Target.IDColumn)
	require.Equal(t, "tenant_id", spec.Target.TenantColumn)
	require.Equal(t, "revision", spec.Target.RevisionColumn)
	require.Equal(t, "status", spec.Target.StatusColumn)

	spec, err = manifest.Parse(strings.NewReader(`{"job_id":"j","tenant":"t","target":{"table":"x"},
		"transition":{"from":"a","to":"b"},"chunk_size":1,"items":[{"id":"b","revision":1},{"id":"a","revision":1}]}`))
	require.NoError(t, err)
	require.Equal(t, "a", spec.Items[0].ID)
	require.Equal(t, "string", spec.IDType)
}

// Same job id with the same content in any order is the same job; same job
// id with a different tenant, items or chunk size is a conflict and changes
// nothing.
func TestRegisterIdempotentOrConflict(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, fixtureOpts{ids: contiguousIDs(12), chunkSize: 5})
	f.register(t)
	before := f.snapshot(t)
	items := f.spec["items"].([]map[string]any)

	// The same items in another order (the fixture wrote them reversed).
	sameSpec := cloneSpec(f.spec)
	reordered := append([]map[string]any(nil), items...)
	reordered[0], reordered[5] = reordered[5], reordered[0]
	sameSpec["items"] = reordered
	spec := parseFile(t, f.writeFile(t, sameSpec))
	reg, err := manifest.Register(ctx, f.pool, spec)
	require.NoError(t, err)
	require.False(t, reg.Created)
	require.Equal(t, 12, reg.Job.ItemCount)
	require.Equal(t, before, f.snapshot(t))

	changedItem := append([]map[string]any(nil), items...)
	changedItem[3] = map[string]any{"id": changedItem[3]["id"], "revision": 77, "fields": changedItem[3]["fields"]}
	for _, tc := range []struct {
		name   string
		change func(map[string]any)
		want   string
	}{
		{"tenant", func(s map[string]any) { s["tenant"] = "someone-else" }, `tenant (registered "alien-desserts", file "someone-else")`},
		{"chunk size", func(s map[string]any) { s["chunk_size"] = 4 }, "chunk size (registered 5, file 4)"},
		{"one item fewer", func(s map[string]any) { s["items"] = items[1:] }, "items (registered 12, file 11"},
		{"other revision", func(s map[string]any) { s["items"] = changedItem }, "id 9: registered revision 1, file 77"},
		{"transition", func(s map[string]any) {
			s["transition"] = map[string]any{"from": "pending", "to": "shipped"}
		}, "transition (registered pending → cancelled, file pending → shipped)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := cloneSpec(f.spec)
			tc.change(s)
			_, err := manifest.Register(ctx, f.pool, parseFile(t, f.writeFile(t, s)))
			var ce *manifest.RegistrationConflictError
			require.ErrorAs(t, err, &ce)
			require.True(t, errors.Is(err, manifest.ErrRegistrationConflict))
			require.Contains(t, err.Error(), tc.want)
			require.Contains(t, err.Error(), "nothing changed")
			require.Equal(t, before, f.snapshot(t))
		})
	}
	var items2 int
	require.NoError(t, f.pool.QueryRow(ctx, `SELECT count(*) FROM manifest_items`).Scan(&items2))
	require.Equal(t, 12, items2)
}

func TestRegisterChecksTheTarget(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, fixtureOpts{ids: contiguousIDs(2), chunkSize: 5})
	for _, tc := range []struct {
		name   string
		target map[string]any
		want   string
	}{
		{"no table", map[string]any{"table": "nope", "match_fields": []string{"qty"}}, `target table "nope" does not exist`},
		{"no column", map[string]any{"table": "orders", "match_fields": []string{"qty"}, "revision_column": "rev"}, `has no column(s) rev`},
	} {
		s := cloneSpec(f.spec)
		s["target"] = tc.target
		_, err := manifest.Register(ctx, f.pool, parseFile(t, f.writeFile(t, s)))
		require.ErrorContains(t, err, tc.want, tc.name)
	}
	// A value that does not convert to its column's type is refused at
	// registration, not at the first drain.
	s := cloneSpec(f.spec)
	items := []map[string]any{{"id": 1, "revision": 2, "fields": map[string]any{"qty": "two"}}}
	s["items"] = items
	_, err := manifest.Register(ctx, f.pool, parseFile(t, f.writeFile(t, s)))
	require.ErrorIs(t, err, manifest.ErrInvalid)
	require.ErrorContains(t, err, `invalid input syntax for type integer: "two"`)

	var jobs int
	require.NoError(t, f.pool.QueryRow(ctx, `SELECT count(*) FROM manifest_jobs`).Scan(&jobs))
	require.Zero(t, jobs)
}

func cloneSpec(m map[string]any) map[string]any {
	out := make(map[string]any, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

func parseFile(t *testing.T, path string) manifest.Spec {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	spec, err := manifest.Parse(f)
	require.NoError(t, err)
	return spec
}
