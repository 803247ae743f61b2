//go:build failpoint

package batch

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/outboxrelay/outboxrelay/internal/failpoint"
)

// hit kills the process at the named point when a test armed it.
func hit(name string) { failpoint.Hit(name) }

// injectedFailure makes PostgreSQL fail tx with a serialization failure
// (SQLSTATE 40001) at the named point when a test armed it: the chunk then
// meets the error a concurrent writer can cause, and IsRetryable classifies
// it as it would in production.
func injectedFailure(ctx context.Context, tx pgx.Tx, name string) error {
	if !failpoint.Fires(name) {
		return nil
	}
	_, err := tx.Exec(ctx, fmt.Sprintf(
		`DO $$BEGIN RAISE EXCEPTION 'injected at %s' USING ERRCODE = 'serialization_failure'; END$$`, name))
	if err == nil {
		return fmt.Errorf("failpoint %s: PostgreSQL raised no error", name)
	}
	return err
}
