//go:build !failpoint

package sink

// Release builds have no failpoints (see internal/failpoint).
func hit(string) {}
