package reconcile

// WithBeforeMove returns o with a function that runs between the count of
// documents without a processor version and the alias move.
func WithBeforeMove(o CutoverOptions, f func()) CutoverOptions {
	o.beforeMove = f
	return o
}

// WithAfterMove returns o with a function that runs right after the alias
// move; its error fails the move as a later step would.
func WithAfterMove(o CutoverOptions, f func() error) CutoverOptions {
	o.afterMove = f
	return o
}

// WithAfterSummaries returns cfg with a function that runs between the
// bucket summaries and the id-by-id read of the buckets that differed.
func WithAfterSummaries(cfg Config, f func()) Config {
	cfg.afterSummaries = f
	return cfg
}
