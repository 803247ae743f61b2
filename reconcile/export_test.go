package reconcile

// WithBeforeMove returns o with a function that runs between the count of
// documents without a processor version and the alias move.
func WithBeforeMove(o CutoverOptions, f func()) CutoverOptions {
	o.beforeMove = f
	return o
}
