package metrics

import "time"

// SetClock replaces time.Now for the readiness cache (tests).
func SetClock(h *Health, now func() time.Time) { h.now = now }
