package batch

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// What a custom [Processor] gets from its context (seed 002): which chunk
// it works on, as an idempotency key for its external calls, and the job's
// rate limiter for those calls.

// ChunkInfo says which chunk a [Processor] call belongs to. Read it with
// [ChunkInfoFrom].
type ChunkInfo struct {
	Job, RunID, Partition string
	// Attempt is the partition's attempt (batch_runs.attempt: it grows
	// when a worker takes the partition up again after a failure, a crash
	// or a stop).
	Attempt int
	// Retry is the chunk's retry within the attempt (0 = first try).
	Retry int64
	// Rows identifies the rows of this Processor call: a hash of their ids
	// and versions, in order.
	Rows string
}

// IdempotencyKey is the run id and attempt (with job and partition) and
// the call's rows: the same for every retry of a call within one attempt,
// so an external service that deduplicates by it sees a retried call as
// the same call, and different for every other call (each chunk, each
// concurrent group of a chunk). A later attempt redoes uncommitted chunks
// under a new key; to dedupe across attempts, key by RunID and each row's
// id and version instead.
func (c ChunkInfo) IdempotencyKey() string {
	return fmt.Sprintf("%s/%s/%s/%d/%s", c.Job, c.RunID, c.Partition, c.Attempt, c.Rows)
}

// forCall returns ctx with the ChunkInfo of one Processor call over rows.
func forCall(ctx context.Context, rows []SourceRow) context.Context {
	e, ok := ctx.Value(procEnvKey{}).(*procEnv)
	if !ok {
		return ctx
	}
	h := sha256.New()
	for _, r := range rows {
		fmt.Fprintf(h, "%d:%s:%d;", len(r.ID), r.ID, r.Version)
	}
	c := *e
	c.info.Rows = hex.EncodeToString(h.Sum(nil)[:12])
	return withProcEnv(ctx, &c)
}

// ChunkInfoFrom returns the chunk a Processor's ctx belongs to.
func ChunkInfoFrom(ctx context.Context) (ChunkInfo, bool) {
	e, ok := ctx.Value(procEnvKey{}).(*procEnv)
	if !ok {
		return ChunkInfo{}, false
	}
	return e.info, true
}

// Wait blocks until the job's rate limiter ([Config].RateLimit) allows one
// external call, or ctx ends. A Processor calls it before each call to an
// external service. Without a rate limit (or outside a Processor) it
// returns at once.
func Wait(ctx context.Context) error {
	e, ok := ctx.Value(procEnvKey{}).(*procEnv)
	if !ok || e.limiter == nil {
		return nil
	}
	start := time.Now()
	err := e.limiter.wait(ctx)
	if e.metrics != nil {
		e.metrics.RateLimitWait.WithLabelValues(e.info.Job).Observe(time.Since(start).Seconds())
	}
	return err
}

// RetryAfterError is what a Processor returns (as its error) when an
// external service asked it to come back later (HTTP 429 or 503 with
// Retry-After). The chunk rolls back and is retried, within
// errors.max_retries, no sooner than After, and the job's rate limiter
// holds every call of this process until then.
type RetryAfterError struct {
	After time.Duration
	Err   error
}

func (e *RetryAfterError) Error() string {
	return fmt.Sprintf("retry after %s: %v", e.After, e.Err)
}

func (e *RetryAfterError) Unwrap() error { return e.Err }

type procEnvKey struct{}

type procEnv struct {
	info    ChunkInfo
	limiter *limiter
	metrics *Metrics
}

func withProcEnv(ctx context.Context, e *procEnv) context.Context {
	return context.WithValue(ctx, procEnvKey{}, e)
}

// limiter is a token bucket that a Retry-After can pause.
type limiter struct {
	lim   *rate.Limiter
	mu    sync.Mutex
	until time.Time // no call before this (the latest Retry-After)
}

func newLimiter(perSecond float64, burst int) *limiter {
	if perSecond <= 0 {
		return &limiter{lim: rate.NewLimiter(rate.Inf, 1)}
	}
	return &limiter{lim: rate.NewLimiter(rate.Limit(perSecond), max(burst, 1))}
}

func (l *limiter) wait(ctx context.Context) error {
	l.mu.Lock()
	until := l.until
	l.mu.Unlock()
	if d := time.Until(until); d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-t.C:
		}
	}
	return l.lim.Wait(ctx)
}

func (l *limiter) pause(d time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if t := time.Now().Add(d); t.After(l.until) {
		l.until = t
	}
}

// retryAfter returns the Retry-After of err, if it carries one.
func retryAfter(err error) (time.Duration, bool) {
	var ra *RetryAfterError
	if errors.As(err, &ra) {
		return max(ra.After, 0), true
	}
	return 0, false
}

// retryAfterBackOff waits at least the Retry-After the last attempt got.
type retryAfterBackOff struct {
	inner interface {
		NextBackOff() time.Duration
		Reset()
	}
	next time.Duration
}

func (b *retryAfterBackOff) NextBackOff() time.Duration {
	d := b.inner.NextBackOff()
	if d >= 0 && b.next > d {
		d = b.next
	}
	b.next = 0
	return d
}

func (b *retryAfterBackOff) Reset() { b.inner.Reset(); b.next = 0 }
