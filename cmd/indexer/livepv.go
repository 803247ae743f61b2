package main

import (
	"context"
	"fmt"
	"io"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/reconcile"
)

// registerLiveDatabase adds DATABASE_URL (and ROUTES, which say which
// jobs write the alias) to a command that moves the aliases without the
// cutover's checks (rollback): with it, the move is recorded as the jobs'
// live processor version, which the batcher enforces.
func registerLiveDatabase(fs *cli.FlagSet, s *settings) {
	fs.SecretOrFile(&s.common.DatabaseURL, "database-url", "DATABASE_URL", "PostgreSQL connection string, e.g. postgres://user:pass@localhost:5432/db: records the processor version now live for the jobs that write the alias (batcher runs at another one are refused); without it nothing is recorded")
	s.common.BindRequireTLS(fs)
	fs.String(&s.routes, "routes", "ROUTES", "", `as for indexer run: the jobs whose aggregate type routes to the alias are the ones whose live processor version is recorded`)
}

// recordRollback records the processor version of index, which the
// aliases now read, as live for the jobs that write the alias.
func recordRollback(ctx context.Context, stdout io.Writer, s *settings, index string) error {
	if s.common.DatabaseURL == "" {
		fmt.Fprintf(stdout, "DATABASE_URL is not set: the jobs' live processor version is not recorded (batch_processor_versions); "+
			"batcher runs at the version of %s are refused until it is (pass DATABASE_URL to indexer rollback)\n", index)
		return nil
	}
	pool, err := s.common.OpenDB(ctx, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	jobs, err := reconcile.RecordRollback(ctx, s.cfg, pool, index)
	if err != nil {
		return fmt.Errorf("the aliases moved to %s, but recording the jobs' live processor version failed: batcher runs at its version are refused "+
			"until batch_processor_versions records it (do not roll back again to retry: that rolls forward): %w", index, err)
	}
	if len(jobs) > 0 {
		fmt.Fprintf(stdout, "live processor version of %s recorded for job(s) %s\n", index, strings.Join(jobs, ", "))
	}
	return nil
}

// checkProcessorVersions sets which processor versions the indexer builds
// generations for: PROCESSOR_VERSIONS, and those the jobs registered in
// pool's batch_processor_versions (nil pool: none). Neither: every
// version, with a warning.
func (s *settings) checkProcessorVersions(pool *pgxpool.Pool) {
	s.cfg.ProcessorVersions = splitList(s.processorVersions)
	if pool != nil {
		s.cfg.RegisteredVersions = func(ctx context.Context) ([]string, error) { return batch.RegisteredVersions(ctx, pool) }
	}
	if pool == nil && len(s.cfg.ProcessorVersions) == 0 && s.cfg.Logger != nil {
		s.cfg.Logger.Warn("neither DATABASE_URL nor PROCESSOR_VERSIONS is set: an index generation is created for any processor version a record's header names")
	}
}
