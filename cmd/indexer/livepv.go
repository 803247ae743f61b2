package main

import (
	"context"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/batch"
)

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
