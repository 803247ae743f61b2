package batch

import (
	"math"
	"sync"
	"time"
)

// Sizer adapts the chunk size toward a target chunk duration. Each step
// changes the size by at most ×1.5 up or ×0.5 down (dampening, so one slow
// chunk does not swing it), within [Min, Max]; a lock wait or an error
// halves it at once.
type Sizer struct {
	Min, Max int
	Target   time.Duration

	mu   sync.Mutex // chunks in flight back off from their own goroutines
	size int
}

// NewSizer starts at size, clamped to [min, max].
func NewSizer(size, min, max int, target time.Duration) *Sizer {
	s := &Sizer{Min: min, Max: max, Target: target}
	s.size = s.clamp(float64(size))
	return s
}

// Size is the size of the next chunk.
func (s *Sizer) Size() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.size
}

// Observe feeds the duration of a chunk of n rows. A chunk smaller than the
// size asked for (the end of the range) says nothing about speed.
func (s *Sizer) Observe(n int, d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n < s.size || d <= 0 {
		return
	}
	ratio := float64(s.Target) / float64(d)
	ratio = math.Min(1.5, math.Max(0.5, ratio))
	s.size = s.clamp(float64(s.size) * ratio)
}

// Backoff halves the size after a lock wait or an error.
func (s *Sizer) Backoff() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.size = s.clamp(float64(s.size) * 0.5)
}

func (s *Sizer) clamp(v float64) int {
	return int(math.Round(math.Min(float64(s.Max), math.Max(float64(s.Min), v))))
}
