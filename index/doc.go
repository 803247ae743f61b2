// Package index manages the life of the search engine indices that the
// indexer writes and users search: the engine client, the generations (one
// physical index per alias and processor version, with its metadata in
// _meta.outboxrelay), the read and write aliases and the job-aware read
// alias (each job of an alias live in its own generation), bulk-load
// settings, and the moves between generations (cutover, rollback,
// roll-forward), dropping a generation, and the choice of generations an
// automatic cutover may take.
//
// Package sink (consume and write) creates or adopts a generation when an
// event of a new processor version arrives and ends its bulk-load mode;
// package reconcile (compare and repair) decides whether a generation is
// ready and then asks this package to move the aliases.
//
// # Dependency direction
//
// A cutover's readiness checks compare a generation with the
// normalized_records table (package reconcile's comparison). They stay in
// reconcile, which calls this package for the move ([MoveJob], after
// [PlanMove]); this package imports neither sink nor reconcile, so both
// can import it without a cycle. What a move needs from outside the engine
// is passed in: the aggregate types of the jobs that write the alias
// ([JobMove].JobTypes) and a PostgreSQL pool for the alias's cutover lock
// ([LockAlias]), which serializes moves of one alias across processes.
//
// # Example
//
// Move one job's documents to its rebuilt generation, after the checks:
//
//	client, err := index.NewClient("http://localhost:9200")
//	if err != nil {
//		return err
//	}
//	target, err := index.GenerationTarget(ctx, client, "content", "v2")
//	if err != nil {
//		return err
//	}
//	res, err := index.MoveJob(ctx, client, db, "content", "content-write",
//		index.JobMove{Type: "articles", Target: target, JobTypes: []string{"articles", "notes"}},
//		index.MoveOptions{Job: "articles"})
//	if errors.Is(err, index.ErrUnsafeMove) {
//		// refused: nothing moved; err says why
//	}
//	_ = res.Plan.Whole // the write alias moved too
package index
