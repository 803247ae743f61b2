package reconcile

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/sink"
)

// AutoCutoverOptions configure [AutoCutover].
type AutoCutoverOptions struct {
	// DB holds batch_jobs, batch_runs and normalized_records. Required.
	DB *pgxpool.Pool
	// Jobs whose generations go live automatically. Required.
	Jobs []string
	// Interval between two rounds of checks. Default 30s.
	Interval time.Duration
	// Logger defaults to cfg.Logger, then slog.Default().
	Logger *slog.Logger
}

// AutoCutover makes each job's rebuilt generation live as soon as it is
// ready, until ctx ends: every Interval, for each job whose current
// processor version's generation exists and has never been live, it runs
// [Cutover] (the same checks as indexer cutover, then one _aliases call),
// and logs the move. A generation that was live before and is not now was
// rolled back from: that is the operator's decision, and AutoCutover leaves
// it (indexer cutover --job moves it again). Documents without a processor
// version that the new generation lacks are never hidden automatically
// (CutoverOptions.AllowUnversioned stays off).
//
// Several indexers may run it at once: a round for an alias holds a
// PostgreSQL advisory lock (session-level, on its own connection, so a
// process that dies lets go), and the others skip that alias until the
// next round; the _aliases call itself fails as a whole if the aliases
// moved since they were read, and a generation found live is left as it
// is. Errors are logged and the next round tries again.
func AutoCutover(ctx context.Context, cfg sink.Config, opts AutoCutoverOptions) error {
	cfg = cfg.WithDefaults()
	if opts.DB == nil || len(opts.Jobs) == 0 {
		return &sink.ConfigError{Err: errors.New("AutoCutoverOptions.DB and AutoCutoverOptions.Jobs are required")}
	}
	opts.Interval = cmp.Or(opts.Interval, 30*time.Second)
	log := cmp.Or(opts.Logger, cfg.Logger, slog.Default())
	waiting := map[string]string{} // job -> the index it last logged waiting for
	tick := time.NewTicker(opts.Interval)
	defer tick.Stop()
	for {
		for _, job := range opts.Jobs {
			res, alias, skip, err := autoCutoverOnce(ctx, cfg, opts.DB, job)
			l := log.With(slog.String("job", job), slog.String("index", res.Index))
			switch {
			case ctx.Err() != nil:
				return nil
			case skip == skipNoJob:
				if waiting[job] != skip {
					l.Info("automatic cutover: the job has not run yet (no spec in batch_jobs); checking again every interval")
					waiting[job] = skip
				}
			case skip == skipRolledBack:
				if waiting[job] != res.Index+skip {
					l.Info("automatic cutover: the generation was live before and was rolled back from; left to the operator (indexer cutover --job)",
						slog.String("alias", alias))
					waiting[job] = res.Index + skip
				}
			case err == nil && skip == "":
				l.Info("automatic cutover: the read alias moved to the rebuilt generation",
					slog.String("alias", alias), slog.String("processor_version", res.ProcessorVersion),
					slog.Any("from", res.From), slog.Int64("documents", res.IndexDocs), slog.Int64("source_rows_changed_since_read", res.Behind.Total()))
				delete(waiting, job)
			case errors.Is(err, index.ErrUnsafeMove):
				if waiting[job] != res.Index {
					l.Info("automatic cutover: waiting for the generation to be ready", slog.String("missing", err.Error()))
					waiting[job] = res.Index
				} else {
					l.Debug("automatic cutover: not ready", slog.String("missing", err.Error()))
				}
			case err != nil:
				l.Warn("automatic cutover: check failed; trying again next round", slog.String("error", err.Error()))
			default:
				l.Debug("automatic cutover: nothing to do", slog.String("generation", skip))
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// Why a round of [AutoCutover] did not try a generation.
const (
	skipNoJob      = "no job"             // the job has not run yet (batch_jobs has no spec)
	skipLive       = index.SkipLive       // the read alias points at it
	skipRolledBack = index.SkipRolledBack // live before, not now
	skipLocked     = "locked"             // another process holds the alias's cutover lock
)

// autoCutoverOnce is one round of [AutoCutover] for job, whose generations
// belong to alias. skip says why it did not try the generation ("" when it
// tried); a generation not ready is an error wrapping [index.ErrUnsafeMove].
// It moved the aliases when both are empty.
func autoCutoverOnce(ctx context.Context, cfg sink.Config, db *pgxpool.Pool, job string) (res CutoverResult, alias, skip string, err error) {
	j, err := LoadJob(ctx, db, job)
	if errors.Is(err, ErrUnknownJob) {
		return res, "", skipNoJob, nil
	}
	if err != nil {
		return res, "", "", err
	}
	res.Job, res.ProcessorVersion = j.Name, j.ProcessorVersion
	cfg = cfg.ForAggregateType(j.AggregateType)
	alias = cfg.Alias
	client, err := index.NewClientWith(cfg.URL, cfg.HTTPClient)
	if err != nil {
		return res, alias, "", err
	}
	if res.Index, err = index.GenerationTarget(ctx, client, cfg.Alias, j.ProcessorVersion); err != nil {
		return res, alias, "", err
	}
	if back, err := rolledBackFrom(ctx, db, job, j.ProcessorVersion); back || err != nil {
		return res, alias, skipRolledBack, err
	}
	if skip, err := index.Candidate(ctx, client, cfg.Alias, cfg.WriteAlias, res.Index, j.AggregateType); skip != "" || err != nil {
		if skip == skipLive && err == nil {
			err = repairLive(ctx, db, j)
		}
		return res, alias, skip, err
	}
	unlock, locked, err := index.TryLockAlias(ctx, db, cfg.Alias)
	if err != nil {
		return res, alias, "", fmt.Errorf("automatic cutover of job %s: %w", job, err)
	}
	if !locked {
		return res, alias, skipLocked, nil
	}
	defer unlock()
	// Again under the lock: another indexer may have moved it meanwhile.
	if skip, err := index.Candidate(ctx, client, cfg.Alias, cfg.WriteAlias, res.Index, j.AggregateType); skip != "" || err != nil {
		if skip == skipLive && err == nil {
			err = repairLive(ctx, db, j)
		}
		return res, alias, skip, err
	}
	res, err = Cutover(ctx, cfg, CutoverOptions{DB: db, Job: job, locked: true, auto: true})
	if err == nil && res.Already {
		skip = skipLive
	}
	return res, alias, skip, err
}

// repairLive records j.ProcessorVersion as j's live version when its
// generation is live for j's documents but PostgreSQL records another
// version (or none): a move whose _aliases call succeeded and whose
// recording failed, or a process that died in between.
func repairLive(ctx context.Context, db *pgxpool.Pool, j Job) error {
	live, err := batch.LoadLiveVersion(ctx, db, j.Name)
	switch {
	case errors.Is(err, batch.ErrNotFound):
	case err != nil:
		return err
	case live.ProcessorVersion == j.ProcessorVersion:
		return nil
	}
	return recordLive(ctx, db, j.Name, j.ProcessorVersion, batch.MovedByAutoCutover, "")
}
