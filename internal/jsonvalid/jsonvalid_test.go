package jsonvalid

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

var jsonValidCases = []string{
	``, ` `, `{}`, ` {} `, `{ }`, `[]`, `[ ]`, `{"a":1}`, `{"a":1,}`, `{"a" : 1 , "b" : [1, 2, {"c": null}]}`,
	`{"a"}`, `{"a":}`, `{a:1}`, `{"a":1 "b":2}`, `{"a":1}}`, `{"a":1}x`, `{"a":1} {"b":2}`, `[1,]`, `[,1]`,
	`true`, `false`, `null`, `tru`, `truex`, `nul`, `nulll`, `True`,
	`0`, `-0`, `01`, `-01`, `1.`, `1.5`, `.5`, `1e`, `1e5`, `1E+5`, `1e-5`, `1.5e+10`, `-`, `+1`, `1ee5`, `-1.0e0`, `1.e5`,
	`""`, `"abc"`, `"abc`, `"a\"b"`, `"a\\"`, `"a\/b"`, `"\b\f\n\r\t"`, `"\x"`, `"\u00e9"`, `"\u00E9"`, `"\u00g9"`, `"\u00e"`, `"\u"`,
	"\"a\tb\"", "\"a\x7fb\"", "\"\xff\xfe\"", "\"a\x1fb\"", "\"a\x00b\"", "\"abcdefgh\x01ijklmnop\"", "\"abcdefghijklmnop\\\"qrstuvwx\"",
	"{\"a\":\n1}", "\t[1]\r\n", "\v[1]", "\u00a0[1]",
	`{"title":"` + strings.Repeat("lorem ipsum ", 40) + `","n":12345,"tags":["x","y"]}`,
	strings.Repeat("[", 10000) + strings.Repeat("]", 10000),
	strings.Repeat("[", 10001) + strings.Repeat("]", 10001),
	strings.Repeat(`{"a":`, 10000) + "1" + strings.Repeat("}", 10000),
	strings.Repeat(`{"a":`, 10001) + "1" + strings.Repeat("}", 10001),
}

func TestValidJSONMatchesEncodingJSON(t *testing.T) {
	t.Parallel()
	for _, c := range jsonValidCases {
		// Every prefix too: the cut lands inside strings, numbers,
		// literals and the eight-byte fast path.
		for n := range min(len(c), 200) + 1 {
			require.Equal(t, json.Valid([]byte(c[:n])), Valid([]byte(c[:n])), "%q", c[:n])
		}
		require.Equal(t, json.Valid([]byte(c)), Valid([]byte(c)), "%.80q", c)
	}
}

func FuzzValidJSON(f *testing.F) {
	for _, c := range jsonValidCases {
		f.Add([]byte(c))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if got, want := Valid(b), json.Valid(b); got != want {
			t.Fatalf("Valid(%q) = %v, json.Valid says %v", b, got, want)
		}
	})
}

func BenchmarkValidJSON(b *testing.B) {
	doc := []byte(`{"id":"doc-0000001","tenant":"tenant-001","title":"Benchmark document number 1","status":"active","amount":7,"tags":["alpha","beta","gamma"],"created_at":"2026-01-01T00:00:00Z","body":"` + strings.Repeat("lorem ipsum ", 29) + `"}`)
	b.SetBytes(int64(len(doc)))
	b.Run("Valid", func(b *testing.B) {
		for b.Loop() {
			Valid(doc)
		}
	})
	b.Run("json.Valid", func(b *testing.B) {
		for b.Loop() {
			json.Valid(doc)
		}
	})
}
