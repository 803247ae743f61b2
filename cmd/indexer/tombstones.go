package main

import (
	"context"
	"io"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/sink"
)

// purgeSettings are the tombstone purge's settings, shared by indexer
// tombstones purge and indexer run's schedule.
type purgeSettings struct {
	margin   time.Duration
	noOutbox bool
	interval time.Duration // indexer run only
}

func (p *purgeSettings) register(fs *cli.FlagSet) {
	fs.Duration(&p.margin, "tombstone-purge-margin", "TOMBSTONE_PURGE_MARGIN", sink.DefaultPurgeMargin, "subtracted from the oldest record that could replay an older version (clock skew between producers, PostgreSQL and the indexer)")
	fs.Bool(&p.noOutbox, "tombstone-purge-no-outbox", "TOMBSTONE_PURGE_NO_OUTBOX", false, "no outbox writes to the topic (another producer's topic): skip outbox_events and outbox_dead_letters, so no DATABASE_URL is needed")
}

// validate checks the settings before anything is probed.
func (p *purgeSettings) validate(databaseURL string, scheduled bool) error {
	switch {
	case p.margin < 0:
		return cli.UsageError("TOMBSTONE_PURGE_MARGIN=%s: want ≥ 0", p.margin)
	case p.interval < 0:
		return cli.UsageError("TOMBSTONE_PURGE_INTERVAL=%s: want ≥ 0 (0 = off)", p.interval)
	case scheduled && p.interval == 0:
		return nil
	case databaseURL == "" && !p.noOutbox:
		what := "indexer tombstones purge"
		if scheduled {
			what = "TOMBSTONE_PURGE_INTERVAL=" + p.interval.String()
		}
		return cli.UsageError("%s needs DATABASE_URL (unpublished and dead-lettered outbox rows bound the horizon), or TOMBSTONE_PURGE_NO_OUTBOX=true when no outbox writes to the topic", what)
	}
	return nil
}

func (p *purgeSettings) options(pool *pgxpool.Pool, dryRun bool) sink.PurgeOptions {
	opts := sink.PurgeOptions{Margin: p.margin, DryRun: dryRun}
	if pool != nil && !p.noOutbox {
		opts.DB = pool
	}
	return opts
}

const purgeHelp = "Deletes the delete tombstones ({\"_deleted\":true} documents) that no replay can undo any more, from\n" +
	"every index generation of the alias (and of the ROUTES aliases). A tombstone of id X at version V\n" +
	"guards against an upsert of X older than V arriving late; once it is gone, the engine accepts one\n" +
	"again (after index.gc_deletes). So a tombstone goes only when its _deleted_at (when the indexer\n" +
	"wrote it) is before the horizon: the oldest record of\n" +
	"  - the topic, from each partition's earliest retained offset (a group may be reset, or a\n" +
	"    generation rebuilt from the start),\n" +
	"  - the dead-letter topic, from the dead-letter replay group's position,\n" +
	"  - outbox_events and outbox_dead_letters rows of the topic,\n" +
	"minus TOMBSTONE_PURGE_MARGIN. Every older version of X was written before the delete, so none is\n" +
	"left in any of them. Tombstones are deleted by query matching only documents that are still\n" +
	"tombstones older than the horizon; one re-upserted meanwhile is a version conflict, skipped.\n" +
	"Tombstones written before _deleted_at existed are counted and kept. Prints the horizon, the source\n" +
	"that bounded it, and per index how many tombstones were (--dry-run: would be) purged and kept.\n" +
	"Not covered: an event older than a delete re-published into the topic after that delete (a\n" +
	"publisher dead-letter retry or a dead-letter replay of an old event): its record is newer than\n" +
	"the tombstone. Only TOPIC bounds the horizon: when several topics (indexers) write into one\n" +
	"index, purge with the topic whose oldest record is the oldest, or not at all."

func purgeCommand(stdout io.Writer) cli.Command {
	return cli.Command{
		Name:    "tombstones purge",
		Summary: "delete the tombstones older than the replay horizon (printed, with the source bounding it)",
		Run: func(ctx context.Context, args []string) error {
			var s settings
			var p purgeSettings
			var dryRun bool
			fs := cli.NewFlagSet("indexer tombstones purge", purgeHelp)
			s.common.RegisterDatabase(fs)
			s.registerKafka(fs)
			s.registerEngine(fs)
			fs.String(&s.routes, "routes", "ROUTES", "", `as for indexer run: the ROUTES aliases are purged too`)
			p.register(fs)
			fs.Bool(&dryRun, "dry-run", "", false, "print the horizon and count the tombstones that would go; delete nothing")
			s.common.RegisterLogging(fs)
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			if err := p.validate(s.common.DatabaseURL, false); err != nil {
				return err
			}
			if _, err := s.load(ctx, true); err != nil {
				return err
			}
			var pool *pgxpool.Pool
			if !p.noOutbox {
				var err error
				if pool, err = s.common.OpenDB(ctx, 2); err != nil {
					return err
				}
				defer pool.Close()
			}
			res, err := sink.PurgeTombstones(ctx, s.cfg, p.options(pool, dryRun))
			if err != nil {
				return usageIfConfig(err)
			}
			res.Write(stdout, dryRun)
			return nil
		},
	}
}

// purgeEvery runs the purge every interval until ctx ends; a failed purge
// is logged and tried again at the next one.
func purgeEvery(ctx context.Context, cfg sink.Config, p purgeSettings, pool *pgxpool.Pool, logger *slog.Logger) {
	t := time.NewTicker(p.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		res, err := sink.PurgeTombstones(ctx, cfg, p.options(pool, false))
		if err != nil {
			if ctx.Err() == nil {
				logger.Warn("tombstone purge failed", slog.String("error", err.Error()))
			}
			continue
		}
		var purged, kept int64
		for _, pi := range res.Indices {
			purged += pi.Purged
			kept += pi.Kept
		}
		logger.Info("tombstones purged", slog.Time("horizon", res.Horizon.At), slog.String("bounded_by", res.Horizon.BoundedBy),
			slog.Int64("purged", purged), slog.Int64("kept", kept))
	}
}
