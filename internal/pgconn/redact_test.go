package pgconn_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/pgconn"
)

// A connection string that does not connect (nothing listens on port 1)
// is named in the error with its password masked, in every form pgx
// accepts, also when the password has characters url.Parse misreads.
func TestOpenErrorMasksPassword(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ url, password, shown string }{
		{"postgres://relay:#s3cret-a@127.0.0.1:1/x?connect_timeout=5", "s3cret-a", "DATABASE_URL=postgres://relay:xxxxx@127.0.0.1:1/x?connect_timeout=5: cannot connect: "},
		{"postgres://relay:123?s3cret-b@127.0.0.1:1/x", "s3cret-b", "DATABASE_URL=postgres://relay:xxxxx@127.0.0.1:1/x: cannot connect: "},
		{"postgres://relay@127.0.0.1:1/x?sslmode=disable&sslpassword=s3cret-c", "s3cret-c", "sslpassword=xxxxx"},
		{`host=127.0.0.1 port=1 user=relay password='a\'b s3cret-d' dbname=x`, "s3cret-d", `password=xxxxx dbname=x: cannot connect: `},
		{"postgres://relay:#s3cret-e@127.0.0.1:1,127.0.0.1:2/x", "s3cret-e", "DATABASE_URL=postgres://relay:xxxxx@127.0.0.1:1,127.0.0.1:2/x: cannot connect: "},
	} {
		_, err := pgconn.Open(context.Background(), tc.url, 1)
		require.Error(t, err, tc.url)
		require.NotContains(t, err.Error(), tc.password)
		require.Contains(t, err.Error(), tc.shown)
	}
}

// ConnectError masks a password the driver's error quotes.
func TestConnectErrorMasksTheCause(t *testing.T) {
	t.Parallel()
	const url = "postgres://relay:#quoted-s3cret@db/x"
	_, _ = pgconn.Open(context.Background(), "postgres://relay:#quoted-s3cret@127.0.0.1:1/x", 1) // registers the password
	cause := errors.New("server said: password \"#quoted-s3cret\" rejected\n  on line two")
	err := pgconn.ConnectError(url, cause)
	require.ErrorIs(t, err, cause)
	require.Equal(t, `DATABASE_URL=postgres://relay:xxxxx@db/x: cannot connect: server said: password "xxxxx" rejected on line two`, err.Error())
}
