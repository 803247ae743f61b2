package batch

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// The live processor version of a job (batch_processor_versions, migration
// 016) is the one whose index generation searches read. The batcher
// records a job's first version as live when it first runs (unless another
// version of the job is registered, by migration 016: then the first
// cutover or rollback records it); an indexer cutover or rollback moves it
// ([SetLiveVersion]). A run at another version
// is a rebuild of that version's generation: allowed when the version has
// never been live (the upgrade's rebuild), refused with a [LiveVersionError]
// when it was live before (an old schedule still running after a cutover,
// or the new one after a rollback) unless StartOptions.Rebuild declares it.

// ErrNotLive is wrapped by a [LiveVersionError].
var ErrNotLive = errors.New("processor version is not the job's live one")

// LiveVersionError refuses a run at a processor version that was live
// before and is not now; it wraps [ErrNotLive]. Error names the
// StartOptions field that declares a rebuild; a front end that calls it
// something else (the batcher's --rebuild) prints [LiveVersionError.Message].
type LiveVersionError struct {
	Job, ProcessorVersion, Live string
	// LiveSince is when Live became live.
	LiveSince time.Time
}

func (e *LiveVersionError) Error() string { return e.Message("StartOptions.Rebuild") }

// Message is Error with rebuild as the name of StartOptions.Rebuild.
func (e *LiveVersionError) Message(rebuild string) string {
	return fmt.Sprintf("job %s: processor version %s was live before and is not now: %s is live since %s; "+
		"a run at %s would move every row of normalized_records back to %s and send every later change to %s's index generation, "+
		"which searches no longer read. Run the job at %s (its current spec), "+
		"or make %s live first (indexer rollback, when %s is the generation %s replaced; else rebuild it with %s, then indexer cutover --job %s); "+
		"or pass %s to rebuild %s beside the live %s. Nothing changed",
		e.Job, e.ProcessorVersion, e.Live, e.LiveSince.UTC().Format(time.RFC3339), e.ProcessorVersion, e.ProcessorVersion, e.ProcessorVersion,
		e.Live, e.ProcessorVersion, e.ProcessorVersion, e.Live, rebuild, e.Job, rebuild, e.ProcessorVersion, e.Live)
}

func (e *LiveVersionError) Unwrap() error { return ErrNotLive }

const (
	// firstRunSQL records processor version $2 as live for job $1 when
	// the job has no live version and no other registered version (its
	// first run). Migration 016 registers, none live, the versions jobs ran
	// at before it: when another is registered, which one searches read is
	// unknown here, and the next cutover or rollback records it.
	firstRunSQL = `
INSERT INTO batch_processor_versions AS v (job, processor_version, live, first_live_at, live_since)
SELECT $1, $2, true, now(), now()
WHERE NOT EXISTS (SELECT FROM batch_processor_versions WHERE job = $1 AND (live OR processor_version <> $2))
ON CONFLICT (job, processor_version) DO UPDATE SET
  live = true, first_live_at = coalesce(v.first_live_at, now()), live_since = now(), left_at = NULL`
	registerRebuildSQL = `
INSERT INTO batch_processor_versions (job, processor_version) VALUES ($1, $2)
ON CONFLICT (job, processor_version) DO NOTHING`
	// jobVersionsSQL: the live version of job $1 and whether $2 was ever live.
	jobVersionsSQL = `
SELECT (SELECT processor_version FROM batch_processor_versions WHERE job = $1 AND live),
       (SELECT live_since FROM batch_processor_versions WHERE job = $1 AND live),
       coalesce((SELECT first_live_at IS NOT NULL FROM batch_processor_versions WHERE job = $1 AND processor_version = $2), false)`
	leaveLiveSQL = `
UPDATE batch_processor_versions SET live = false, left_at = now()
WHERE job = $1 AND live AND processor_version <> $2
RETURNING processor_version`
	enterLiveSQL = `
INSERT INTO batch_processor_versions AS v (job, processor_version, live, first_live_at, live_since)
VALUES ($1, $2, true, now(), now())
ON CONFLICT (job, processor_version) DO UPDATE SET
  live = true, first_live_at = coalesce(v.first_live_at, now()), live_since = now(), left_at = NULL
WHERE NOT v.live`
	// leftSQL records that processor version $2 of job $1 was live until
	// now (the generation the documents left), registering it if need be.
	leftSQL = `
INSERT INTO batch_processor_versions AS v (job, processor_version, first_live_at, left_at)
VALUES ($1, $2, now(), now())
ON CONFLICT (job, processor_version) DO UPDATE SET
  first_live_at = coalesce(v.first_live_at, now()), left_at = coalesce(v.left_at, now())
WHERE NOT v.live AND v.first_live_at IS NULL`
	auditLiveMoveSQL = `INSERT INTO batch_live_version_moves (job, from_version, to_version, how, actor) VALUES ($1, $2, $3, $4, $5)`
)

// checkLiveVersion runs under the job lock in the transaction that prepares
// a run: a job with no live version and no other registered one gets
// s.ProcessorVersion as its live one;
// a version that was live before and is not now is refused unless
// opts.Rebuild; any allowed version is registered.
func checkLiveVersion(ctx context.Context, tx pgx.Tx, s Spec, opts StartOptions) error {
	var live *string
	var since *time.Time
	var wasLive bool
	if err := tx.QueryRow(ctx, jobVersionsSQL, s.Job, s.ProcessorVersion).Scan(&live, &since, &wasLive); err != nil {
		return fmt.Errorf("read the live processor version of job %s: %w", s.Job, err)
	}
	switch {
	case live == nil:
		tag, err := tx.Exec(ctx, firstRunSQL, s.Job, s.ProcessorVersion)
		if err != nil {
			return fmt.Errorf("record the live processor version of job %s: %w", s.Job, err)
		}
		if tag.RowsAffected() == 1 {
			if _, err := tx.Exec(ctx, auditLiveMoveSQL, s.Job, nil, s.ProcessorVersion, "first run", actor()); err != nil {
				return fmt.Errorf("audit the live processor version of job %s: %w", s.Job, err)
			}
			return nil
		}
		// Another version is registered (by migration 016) and none is
		// live: the run is allowed; a cutover or rollback records live.
	case *live == s.ProcessorVersion:
		return nil
	case wasLive && !opts.Rebuild:
		return &LiveVersionError{Job: s.Job, ProcessorVersion: s.ProcessorVersion, Live: *live, LiveSince: *since}
	}
	if _, err := tx.Exec(ctx, registerRebuildSQL, s.Job, s.ProcessorVersion); err != nil {
		return fmt.Errorf("register processor version %s of job %s: %w", s.ProcessorVersion, s.Job, err)
	}
	return nil
}

// refuseStale refuses work at s's processor version, outside a run
// (quarantine retry), when the version was live before and is not now,
// unless rebuild.
func refuseStale(ctx context.Context, q querier, s Spec, rebuild bool) error {
	if rebuild {
		return nil
	}
	var live *string
	var since *time.Time
	var wasLive bool
	if err := q.QueryRow(ctx, jobVersionsSQL, s.Job, s.ProcessorVersion).Scan(&live, &since, &wasLive); err != nil {
		return fmt.Errorf("read the live processor version of job %s: %w", s.Job, err)
	}
	if live != nil && *live != s.ProcessorVersion && wasLive {
		return &LiveVersionError{Job: s.Job, ProcessorVersion: s.ProcessorVersion, Live: *live, LiveSince: *since}
	}
	return nil
}

// LiveVersion is a job's live processor version as recorded.
type LiveVersion struct {
	Job, ProcessorVersion string
	Since                 time.Time
}

// LoadLiveVersion reads job's live processor version; [ErrNotFound] when
// none is recorded (the job never ran since migration 016).
func LoadLiveVersion(ctx context.Context, db querier, job string) (LiveVersion, error) {
	v := LiveVersion{Job: job}
	err := db.QueryRow(ctx, `SELECT processor_version, live_since FROM batch_processor_versions WHERE job = $1 AND live`, job).Scan(&v.ProcessorVersion, &v.Since)
	if errors.Is(err, pgx.ErrNoRows) {
		return v, fmt.Errorf("%w: no live processor version recorded for job %s", ErrNotFound, job)
	}
	if err != nil {
		return v, fmt.Errorf("read the live processor version of job %s: %w", job, err)
	}
	return v, nil
}

// WasLive reports whether processor version pv of job has ever been live.
func WasLive(ctx context.Context, db querier, job, pv string) (bool, error) {
	var was bool
	err := db.QueryRow(ctx, `SELECT coalesce((SELECT first_live_at IS NOT NULL FROM batch_processor_versions WHERE job = $1 AND processor_version = $2), false)`, job, pv).Scan(&was)
	if err != nil {
		return false, fmt.Errorf("read the live history of job %s: %w", job, err)
	}
	return was, nil
}

// How a job's live processor version moved (batch_live_version_moves.how).
const (
	MovedByCutover     = "cutover"
	MovedByAutoCutover = "automatic cutover"
	MovedByRollback    = "rollback"
)

// SetLiveVersion records that pv's index generation is what searches read
// for job now (an indexer cutover or rollback moved the aliases to it), and
// audits the move with how and the OS user. It returns the version that was
// live before ("" when none was recorded, or pv was live already).
//
// left, optional, is the version whose generation the documents left (its
// _meta processor version; v1 for the bootstrap <alias>_v1): it is recorded
// as having been live, so that a run at it is refused from now on even
// when nothing was recorded live before (a job whose first run after
// migration 016 was already the rebuild).
func SetLiveVersion(ctx context.Context, db DB, job, pv, how string, left ...string) (string, error) {
	if len(left) > 1 {
		return "", fmt.Errorf("record the live processor version of job %s: more than one version left (%v)", job, left)
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return "", err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	if _, err := tx.Exec(ctx, lockJobSQL, job); err != nil {
		return "", fmt.Errorf("lock job %s: %w", job, err)
	}
	var from string
	if err := tx.QueryRow(ctx, leaveLiveSQL, job, pv).Scan(&from); err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return "", fmt.Errorf("record the live processor version of job %s: %w", job, err)
	}
	for _, l := range left {
		if l == "" || l == pv {
			continue
		}
		if _, err := tx.Exec(ctx, leftSQL, job, l); err != nil {
			return "", fmt.Errorf("record that processor version %s of job %s was live: %w", l, job, err)
		}
	}
	tag, err := tx.Exec(ctx, enterLiveSQL, job, pv)
	if err != nil {
		return "", fmt.Errorf("record the live processor version of job %s: %w", job, err)
	}
	if tag.RowsAffected() == 1 {
		var fromArg *string
		switch {
		case from != "":
			fromArg = &from
		case len(left) == 1 && left[0] != "" && left[0] != pv:
			fromArg = &left[0]
		}
		if _, err := tx.Exec(ctx, auditLiveMoveSQL, job, fromArg, pv, how, actor()); err != nil {
			return "", fmt.Errorf("audit the live processor version of job %s: %w", job, err)
		}
	}
	return from, tx.Commit(ctx)
}

// RegisteredVersions lists the processor versions the jobs ran at (every
// version of batch_processor_versions), for the indexer's check of the
// ce_processorversion header.
func RegisteredVersions(ctx context.Context, db querier) ([]string, error) {
	rows, err := db.Query(ctx, `SELECT DISTINCT processor_version FROM batch_processor_versions ORDER BY 1`)
	if err != nil {
		return nil, fmt.Errorf("read the registered processor versions: %w", err)
	}
	pvs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("read the registered processor versions: %w", err)
	}
	return pvs, nil
}

// liveForEventsSQL: the live versions of the jobs whose events go to
// topic $1 as aggregate type $2 (stored specs carry their defaults).
const liveForEventsSQL = `
SELECT v.job, v.processor_version FROM batch_processor_versions v JOIN batch_jobs j USING (job)
WHERE v.live AND coalesce(nullif(j.spec->>'topic', ''), '` + defaultTopic + `') = $1
  AND coalesce(nullif(j.spec->>'aggregate_type', ''), j.spec->'source'->>'table') = $2
ORDER BY v.job`

// LiveVersionForEvents returns the live processor version of the scan jobs
// whose events go to topic as aggregateType (so to one alias), for other
// writers of those documents (manifest jobs): their events carry it as
// ce_processorversion and reach the generation searches read, as the
// jobs' own documents. "" when no such job has a live version; an error
// naming them when they disagree.
func LiveVersionForEvents(ctx context.Context, db DB, topic, aggregateType string) (string, error) {
	rows, err := db.Query(ctx, liveForEventsSQL, topic, aggregateType)
	if err != nil {
		return "", fmt.Errorf("read the live processor version of topic %s, aggregate type %s: %w", topic, aggregateType, err)
	}
	type jobPV struct{ Job, PV string }
	all, err := pgx.CollectRows(rows, pgx.RowToStructByPos[jobPV])
	if err != nil {
		return "", fmt.Errorf("read the live processor version of topic %s, aggregate type %s: %w", topic, aggregateType, err)
	}
	pv := ""
	for i, j := range all {
		if i > 0 && j.PV != pv {
			return "", fmt.Errorf("scan jobs %s (live processor version %s) and %s (live %s) both send aggregate type %s to topic %s: "+
				"which generation an event of another writer belongs to is ambiguous; cut both over to one version", all[0].Job, pv, j.Job, j.PV, aggregateType, topic)
		}
		pv = j.PV
	}
	return pv, nil
}
