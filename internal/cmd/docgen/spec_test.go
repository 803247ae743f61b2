package main

import (
	"reflect"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
)

// The keys read from batch.Spec's source are the keys its yaml tags
// declare, walked by reflection on the compiled type: a key the page
// would miss (a field the source walk cannot follow) fails here.
func TestSpecKeysMatchTheType(t *testing.T) {
	t.Parallel()
	root, err := repoRoot()
	require.NoError(t, err)
	fields, err := specFields(root)
	require.NoError(t, err)
	var got []string
	for _, f := range fields {
		got = append(got, f.Key)
	}
	var want []string
	var walk func(typ reflect.Type, prefix string, seen map[reflect.Type]bool)
	walk = func(typ reflect.Type, prefix string, seen map[reflect.Type]bool) {
		for i := 0; i < typ.NumField(); i++ {
			f := typ.Field(i)
			key, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
			if key == "" || key == "-" {
				continue
			}
			want = append(want, prefix+key)
			ft, sub := f.Type, prefix+key+"."
			for ft.Kind() == reflect.Pointer || ft.Kind() == reflect.Slice {
				if ft.Kind() == reflect.Slice {
					sub = prefix + key + "[]."
				}
				ft = ft.Elem()
			}
			if ft.Kind() != reflect.Struct || seen[ft] {
				continue
			}
			next := map[reflect.Type]bool{ft: true}
			for k := range seen {
				next[k] = true
			}
			walk(ft, sub, next)
		}
	}
	spec := reflect.TypeOf(batch.Spec{})
	walk(spec, "", map[reflect.Type]bool{spec: true})
	require.Equal(t, want, got)
}

// A key without a comment of its own has no description, shown as "—":
// not its struct's first sentence, which is about the struct. A key with
// one keeps it.
func TestSpecKeyWithoutCommentHasNoDescription(t *testing.T) {
	t.Parallel()
	root, err := repoRoot()
	require.NoError(t, err)
	fields, err := specFields(root)
	require.NoError(t, err)
	docs := map[string]string{}
	for _, f := range fields {
		docs[f.Key] = f.Doc
	}
	// Each key has its own comment, not its struct's (source.filter[].column
	// once read "Condition is one filter term…"), and every key has one:
	// a new spec field without a comment fails here.
	require.Equal(t, "Column of the source table the term compares.", docs["source.filter[].column"])
	require.Equal(t, "Schema of the join table. Default: the relation's schema.", docs["document.relations[].through.schema"])
	for _, f := range fields {
		require.NotEmpty(t, f.Doc, "job-spec key %s has no comment in batch/spec.go", f.Key)
	}

	var w strings.Builder
	renderSpec(&w, []specField{{Key: "a.b", Type: "string"}, {Key: "a.c", Type: "integer", Doc: "C counts. Default 2."}})
	require.Contains(t, w.String(), "| `a.b` | string | — |\n| `a.c` | integer | C counts. Default 2. |\n")
}

func TestSummaryKeepsDefaults(t *testing.T) {
	t.Parallel()
	require.Equal(t, "Size is the first chunk's size. Default 1000.",
		summary("Size is the first chunk's size. It adapts. Default 1000."))
	require.Equal(t, "Cursor lists columns (e.g. created_at, id). Default: [id].",
		summary(oneLine("Cursor lists columns (e.g. created_at, id). Long detail here. Default: [id].")))
	require.Equal(t, "Mode is one of them, see Relation. 0 means no limit.",
		summary(oneLine("Mode is one of them, see [Relation]. Other text. 0 means no limit.")))
}
