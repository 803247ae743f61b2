//go:build !failpoint

package manifest

// Release builds have no failpoints (see internal/failpoint).
func hit(string) {}
