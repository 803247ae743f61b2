//go:build !failpoint

package batch

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// Release builds have no failpoints (see internal/failpoint).

func hit(string) {}

func injectedFailure(context.Context, pgx.Tx, string) error { return nil }
