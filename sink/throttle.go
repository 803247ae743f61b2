package sink

import (
	"context"
	"math"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// throttle is the process-wide document budget shared by all lanes: a token
// bucket at the configured MaxRate (or unlimited), lowered
// multiplicatively while the engine answers 429 and raised again, a quarter
// per clean bulk, until it is back at MaxRate (AIMD, as TCP does, so several
// indexers sharing one cluster settle on a fair share).
type throttle struct {
	mu       sync.Mutex
	lim      *rate.Limiter
	max      rate.Limit // configured cap, rate.Inf for none
	minBurst int
	onChange func(limit float64)
}

const (
	throttleFloor    = 10  // docs/s: never stall completely
	throttleDecrease = 0.5 // on a bulk with 429s
	throttleIncrease = 1.25
)

func newThrottle(maxRate float64, batchSize int, onChange func(float64)) *throttle {
	max := rate.Inf
	if maxRate > 0 {
		max = rate.Limit(maxRate)
	}
	t := &throttle{max: max, minBurst: batchSize, onChange: onChange}
	t.lim = rate.NewLimiter(max, t.burst(max))
	t.report()
	return t
}

func (t *throttle) burst(l rate.Limit) int {
	// WaitN fails for n above the burst, and a batch asks for all its
	// documents at once.
	if l == rate.Inf {
		return t.minBurst
	}
	return max(t.minBurst, int(math.Ceil(float64(l))))
}

// wait blocks until n documents may be sent.
func (t *throttle) wait(ctx context.Context, n int) error {
	t.mu.Lock()
	lim := t.lim
	t.mu.Unlock()
	return lim.WaitN(ctx, min(n, lim.Burst()))
}

// overloaded is called after a bulk in which the engine refused items with
// 429; observed is the throughput that bulk achieved (docs/s).
func (t *throttle) overloaded(observed float64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	cur := t.lim.Limit()
	if cur == rate.Inf || float64(cur) > observed {
		cur = rate.Limit(observed)
	}
	next := max(rate.Limit(throttleFloor), cur*throttleDecrease)
	t.set(next)
}

// healthy is called after a bulk without 429s.
func (t *throttle) healthy(observed float64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	cur := t.lim.Limit()
	if cur == t.max {
		return
	}
	next := cur * throttleIncrease
	// Without a configured cap, stop limiting once the limit is well above
	// what the engine actually takes: it no longer binds.
	if next >= t.max || (t.max == rate.Inf && float64(next) > 4*observed && observed > 0) {
		next = t.max
	}
	t.set(next)
}

func (t *throttle) set(l rate.Limit) {
	t.lim.SetLimitAt(time.Now(), l)
	t.lim.SetBurstAt(time.Now(), t.burst(l))
	t.report()
}

func (t *throttle) report() {
	if t.onChange == nil {
		return
	}
	l := t.lim.Limit()
	if l == rate.Inf {
		t.onChange(0)
		return
	}
	t.onChange(float64(l))
}

// limit returns the current limit, 0 for none.
func (t *throttle) limit() float64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	if l := t.lim.Limit(); l != rate.Inf {
		return float64(l)
	}
	return 0
}
