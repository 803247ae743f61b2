package pgconn_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/pgconn"
)

// Which connection strings verify the server, in every form pgx accepts:
// only verify-full and verify-ca do (and require with sslrootcert, which
// pgx, like libpq, treats as verify-ca). The default, prefer, neither
// verifies nor insists on TLS. A non-loopback host that is not verified is
// a warning; with REQUIRE_TLS any TCP host that is not verified, in any
// position of a multi-host string, is an error naming REQUIRE_TLS and what
// to set. A Unix socket does not cross the network.
func TestCheckTLS(t *testing.T) {
	ca := filepath.Join(t.TempDir(), "ca.pem")
	caPEM, _, _ := newCA(t, "check-tls")
	require.NoError(t, os.WriteFile(ca, caPEM, 0o600))
	for _, tc := range []struct {
		name, conn string
		warn       string // "" = no warning
		refuse     string // with REQUIRE_TLS; "" = accepted
	}{
		{"default prefer, remote", "postgres://u:pw@db.example:5432/x", "db.example:5432", "db.example:5432"},
		{"disable, remote", "postgres://u:pw@db.example/x?sslmode=disable", "db.example:5432", "db.example:5432"},
		{"require, remote", "postgres://u:pw@10.1.2.3:5433/x?sslmode=require", "10.1.2.3:5433", "10.1.2.3:5433"},
		{"require with a root cert is verify-ca", "postgres://u:pw@db.example/x?sslmode=require&sslrootcert=" + ca, "", ""},
		{"verify-ca", "postgres://u:pw@db.example/x?sslmode=verify-ca&sslrootcert=" + ca, "", ""},
		{"verify-full", "postgres://u:pw@db.example/x?sslmode=verify-full&sslrootcert=" + ca, "", ""},
		{"verify-full, system roots", "postgres://u:pw@db.example/x?sslmode=verify-full", "", ""},
		{"loopback prefer: no warning, refused", "postgres://u:pw@127.0.0.1:5432/x", "", "127.0.0.1:5432"},
		{"localhost prefer: no warning, refused", "postgres://u:pw@localhost/x", "", "localhost:5432"},
		{"multi-host, second remote", "postgres://u:pw@127.0.0.1:5432,db2.example:5433/x?sslmode=prefer", "db2.example:5433", "127.0.0.1:5432"},
		{"multi-host verify-full", "postgres://u:pw@db1.example,db2.example/x?sslmode=verify-full&sslrootcert=" + ca, "", ""},
		{"key=value, multi-host require", "host=db1.example,db2.example user=u password=pw sslmode=require", "db1.example:5432", "db1.example:5432"},
		{"key=value verify-full", "host=db.example user=u sslmode=verify-full sslrootcert=" + ca, "", ""},
		{"unix socket", "host=/var/run/postgresql user=u", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			warn, err := pgconn.CheckTLS(tc.conn, false)
			require.NoError(t, err)
			if tc.warn == "" {
				require.Empty(t, warn)
			} else {
				require.Contains(t, warn, tc.warn)
				require.Contains(t, warn, "sslmode=verify-full")
				require.NotContains(t, warn, "pw")
			}
			_, err = pgconn.CheckTLS(tc.conn, true)
			if tc.refuse == "" {
				require.NoError(t, err)
				return
			}
			require.Error(t, err)
			require.Contains(t, err.Error(), "REQUIRE_TLS=true")
			require.Contains(t, err.Error(), tc.refuse)
			require.Contains(t, err.Error(), "sslmode=verify-full")
			require.NotContains(t, err.Error(), "pw")
			require.NotContains(t, err.Error(), "\n")
		})
	}
}
