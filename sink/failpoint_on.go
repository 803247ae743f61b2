//go:build failpoint

package sink

import "github.com/outboxrelay/outboxrelay/internal/failpoint"

// hit kills the process at the named point when a test armed it.
func hit(name string) { failpoint.Hit(name) }
