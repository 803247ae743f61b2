package manifest

// SetReportHook makes ReadReport call f between its read of the progress
// and its verification of the audit (a test's chance to commit a chunk in
// between). It returns a function that removes the hook.
func SetReportHook(f func(jobID string)) (restore func()) {
	reportHook = f
	return func() { reportHook = nil }
}
