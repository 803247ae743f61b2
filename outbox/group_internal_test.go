package outbox

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// splitJSONArray finds each element of the arrays PostgreSQL prints (json_agg
// writes ", " between elements; any JSON whitespace is accepted), whatever
// commas, brackets and escaped quotes the elements' strings hold.
func TestSplitJSONArray(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []string
	}{
		{`[]`, nil},
		{` [ ] `, nil},
		{`[{"a":1}]`, []string{`{"a":1}`}},
		{`[{"a":1}, null, {"b":[1,2,{"c":"]"}]}]`, []string{`{"a":1}`, `null`, `{"b":[1,2,{"c":"]"}]}`}},
		{"[\n {\"s\":\"a,b\\\"],[{\"} ,\t\r\n\"x\" , 3 ]", []string{`{"s":"a,b\"],[{"}`, `"x"`, `3`}},
		{`[{"s":"\\"}, {"t":"\\\""}]`, []string{`{"s":"\\"}`, `{"t":"\\\""}`}},
		{`[[],[[]],{}]`, []string{`[]`, `[[]]`, `{}`}},
	} {
		got, err := splitJSONArray([]byte(tc.in), len(tc.want))
		require.NoError(t, err, tc.in)
		var gotS []string
		for _, g := range got {
			gotS = append(gotS, string(g))
			require.True(t, json.Valid(g), "%s: element %s", tc.in, g)
		}
		require.Equal(t, tc.want, gotS, tc.in)
	}
	for _, bad := range []struct {
		in string
		n  int
	}{
		{`{"a":1}`, 1}, {`[1,2`, 2}, {`[1,2]x`, 2}, {`[1,2]`, 3}, {`null`, 0}, {``, 0},
	} {
		_, err := splitJSONArray([]byte(bad.in), bad.n)
		require.Error(t, err, bad.in)
	}
}

// A batch cut by BATCH_BYTES ends before the event group it would split; a
// first group larger than the cut is taken whole.
func TestWholeGroups(t *testing.T) {
	events := []storedEvent{{id: 1}, {id: 2, member: 1}, {id: 2, member: 2}, {id: 2, member: 3}, {id: 3}, {id: 4, member: 1}, {id: 4, member: 2}}
	rb := newRecordBuilder("src", len(events))
	pending := func(e *storedEvent) (pendingEvent, int) { return pendingFor(rb, e, 1000) }
	fit := func(n int, from []storedEvent) []pendingEvent {
		all := make([]pendingEvent, n)
		for i := range all {
			all[i].ev = &from[i]
		}
		return all
	}
	ids := func(all []pendingEvent) (out [][2]int64) {
		for _, pe := range all {
			out = append(out, [2]int64{pe.ev.id, int64(pe.ev.member)})
		}
		return out
	}
	require.Equal(t, [][2]int64{{1, 0}}, ids(wholeGroups(fit(3, events), events, pending)), "inside group 2: back to its start")
	require.Equal(t, [][2]int64{{1, 0}, {2, 1}, {2, 2}, {2, 3}}, ids(wholeGroups(fit(4, events), events, pending)), "at the end of group 2")
	require.Equal(t, [][2]int64{{1, 0}, {2, 1}, {2, 2}, {2, 3}, {3, 0}}, ids(wholeGroups(fit(6, events), events, pending)))
	require.Len(t, wholeGroups(fit(7, events), events, pending), 7, "the whole batch")
	rest := events[1:]
	require.Equal(t, [][2]int64{{2, 1}, {2, 2}, {2, 3}}, ids(wholeGroups(fit(1, rest), rest, pending)), "a first group that does not fit comes whole")

	// A member too large for any call is dead at once, also in a first
	// group taken whole.
	big := []storedEvent{{id: 5, member: 1, headers: []byte(`{}`)}, {id: 5, member: 2, headers: []byte(`{}`), payload: []byte(`{"pad":"` + strings.Repeat("x", 2000) + `"}`)}}
	all := wholeGroups(fit(1, big), big, pending)
	require.Len(t, all, 2)
	require.ErrorIs(t, all[1].err, ErrMessageTooLarge)
}
