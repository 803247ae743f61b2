package batch

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

var (
	// ErrSpec is wrapped by errors about a spec that does not match the
	// database (missing table or column).
	ErrSpec = errors.New("invalid job spec")
	// ErrLeaseLost means another worker owns the partition now (this one was
	// too slow to heartbeat, or the partition was paused and reclaimed). The
	// worker stops without writing anything.
	ErrLeaseLost = errors.New("lease lost: another worker owns the partition")
	// ErrCheckpointIncompatible means the stored run was made with another
	// processor version or scope.
	ErrCheckpointIncompatible = errors.New("checkpoint incompatible with the spec")
	// ErrCheckpointInvariant means a checkpoint write would move the cursor
	// back, past the boundary, or from a cursor other than the stored one.
	ErrCheckpointInvariant = errors.New("checkpoint invariant violated")
	// ErrBadRow is wrapped by the error of a strict (or retry) run that met a
	// row it cannot normalize.
	ErrBadRow = errors.New("bad row")
	// ErrNotFound means no such job, run or partition.
	ErrNotFound = errors.New("not found")
	// ErrIdleTimeout means PostgreSQL ended a chunk's session because its
	// transaction sat idle for the lease TTL: the worker sent nothing for
	// that long (it was stopped or starved, or a custom Processor worked
	// that long on one slice of rows). The chunk rolled back; its
	// connection is gone, so it is not retried in place: the partition
	// fails, and the next run resumes it from its checkpoint.
	ErrIdleTimeout = errors.New("PostgreSQL ended the chunk's transaction: idle for the lease TTL")
	// ErrOpenWriters is wrapped by an [OpenWritersError]: a run did not
	// start because transactions that wrote the source table stayed open
	// longer than [Config].OpenWritersWait. Nothing changed; a later
	// attempt waits again ([Follower] retries by itself).
	ErrOpenWriters = errors.New("transactions that wrote the source table are still open")
)

// OpenWritersError says which transactions a run start gave up waiting for;
// it wraps [ErrOpenWriters]. Error names the setting Config.OpenWritersWait;
// a front end that calls it something else (the batcher's
// OPEN_WRITERS_WAIT) prints [OpenWritersError.Message].
type OpenWritersError struct {
	Job   string
	Table string // the source table, as SQL names it
	// Writers are the transactions still open: virtual transaction id and,
	// unless prepared, " (pid N)".
	Writers []string
	Wait    time.Duration // how long the run start waited
}

func (e *OpenWritersError) Error() string { return e.Message("Config.OpenWritersWait") }

// Message is Error with setting as the name of Config.OpenWritersWait.
func (e *OpenWritersError) Message(setting string) string {
	return fmt.Sprintf("start a run of job %s: transactions %s that wrote %s have been open for over %s (%s); "+
		"they may still commit rows below the new run's boundary, so the run does not start before they end: "+
		"end them (pg_stat_activity, pg_prepared_xacts) or raise %s; nothing changed",
		e.Job, strings.Join(e.Writers, ", "), e.Table, e.Wait, setting, setting)
}

func (e *OpenWritersError) Unwrap() error { return ErrOpenWriters }

// IncompatibleError is a refusal to go on with a stored run; it wraps
// [ErrCheckpointIncompatible]. Error names the [StartOptions] that would let
// the job go on (Restart, Resume); a front end that calls them something
// else (the batcher's --restart and --resume) prints [IncompatibleError.Message].
type IncompatibleError struct {
	// Problem says what differs from the stored run.
	Problem string
	// remedy says what to do, given the names of StartOptions.Restart and
	// StartOptions.Resume.
	remedy func(restart, resume string) string
}

func (e *IncompatibleError) Error() string {
	return e.Message("StartOptions.Restart", "StartOptions.Resume")
}

// Message is Error with restart and resume as the names of
// StartOptions.Restart and StartOptions.Resume.
func (e *IncompatibleError) Message(restart, resume string) string {
	return ErrCheckpointIncompatible.Error() + ": " + e.Problem + "; " + e.remedy(restart, resume)
}

func (e *IncompatibleError) Unwrap() error { return ErrCheckpointIncompatible }

// errPaused stops a partition whose run was paused by an operator.
var errPaused = errors.New("partition paused")

// transientError marks a row error a Processor expects to heal on retry.
type transientError struct{ err error }

func (e *transientError) Error() string { return "transient: " + e.err.Error() }
func (e *transientError) Unwrap() error { return e.err }

// Transient marks err as transient: under the retry policy the chunk is
// rolled back and retried with backoff.
func Transient(err error) error { return &transientError{err: err} }

// IsRetryable reports whether err is worth retrying the chunk for: a row
// error marked [Transient], or a PostgreSQL error that heals (serialization
// failure, deadlock, lock timeout, lost connection). Never a cancellation,
// nor [ErrIdleTimeout] (the chunk's own connection is gone).
func IsRetryable(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var te *transientError
	if errors.As(err, &te) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "40001", "40P01", "55P03", "57P01", "57P02", "57P03", "53300":
			return true
		}
		return len(pgErr.Code) == 5 && pgErr.Code[:2] == "08"
	}
	if pgconn.SafeToRetry(err) || pgconn.Timeout(err) {
		return true
	}
	var ce *pgconn.ConnectError
	return errors.As(err, &ce) || errors.Is(err, pgx.ErrTxClosed)
}

// isIdleTimeout: the server ended the session for idling in a transaction
// (idle_in_transaction_session_timeout).
func isIdleTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "25P03"
}

func isLockTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03"
}

func isUniqueViolation(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505"
}

// BadRowError names a row the processor could not normalize.
type BadRowError struct {
	ID      string
	Code    string
	Message string
}

func (e *BadRowError) Error() string {
	return fmt.Sprintf("%v: row id=%s: %s: %s", ErrBadRow, e.ID, e.Code, e.Message)
}

func (e *BadRowError) Unwrap() error { return ErrBadRow }
