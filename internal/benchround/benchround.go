// Package benchround is what the benchmarks share to run their contenders
// in interleaved rounds (absolute times drift on a shared machine, so each
// benchmark measures its raw baseline in the same rounds): the number of
// rounds and the figures over them.
package benchround

import (
	"cmp"
	"fmt"
	"os"
	"slices"
	"strconv"
	"testing"
)

// Repeats is BENCH_REPEATS, the number of rounds: 3 unless set.
func Repeats(tb testing.TB) int {
	tb.Helper()
	r, err := strconv.Atoi(cmp.Or(os.Getenv("BENCH_REPEATS"), "3"))
	if err != nil || r < 1 {
		tb.Fatalf("BENCH_REPEATS %q: want a positive count", os.Getenv("BENCH_REPEATS"))
	}
	return r
}

// Series is one contender's figures over the rounds.
type Series []float64

func (s Series) sorted() []float64 { x := slices.Clone(s); slices.Sort(x); return x }

// Median is the middle figure (the upper one of an even count).
func (s Series) Median() float64 { x := s.sorted(); return x[len(x)/2] }

// Spread is "min–max", each printed with verb (e.g. "%.0f").
func (s Series) Spread(verb string) string {
	x := s.sorted()
	return fmt.Sprintf(verb+"–"+verb, x[0], x[len(x)-1])
}
