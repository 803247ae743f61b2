package pgconn_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/url"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/pgconn"
	"github.com/outboxrelay/outboxrelay/internal/stack"
)

func TestMain(m *testing.M) { stack.Main(m) }

// sslmode=verify-full against a private PostgreSQL serving TLS with a
// certificate this test made: the right CA connects over TLS; another CA or
// a host name the certificate does not name is refused, in one line naming
// DATABASE_URL with the password redacted.
func TestVerifyFull(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// The server runs as the postgres user: its directory must be reachable.
	dir, err := os.MkdirTemp("", "outboxrelay-pg-tls-")
	require.NoError(t, err)
	require.NoError(t, os.Chmod(dir, 0o755))
	srv := &stack.Server{Kind: "postgres", Dir: dir}
	require.NoError(t, srv.Start())
	t.Cleanup(func() { _ = srv.Stop(); _ = os.RemoveAll(dir) })

	certs := t.TempDir()
	caPEM, caCert, caKey := newCA(t, "pg test CA")
	otherPEM, _, _ := newCA(t, "some other CA")
	caFile, otherFile := filepath.Join(certs, "ca.pem"), filepath.Join(certs, "other.pem")
	require.NoError(t, os.WriteFile(caFile, caPEM, 0o644))
	require.NoError(t, os.WriteFile(otherFile, otherPEM, 0o644))

	// The server's certificate names 127.0.0.1 only.
	data := filepath.Join(dir, "postgres", "data")
	certPEM, keyPEM := newServerCert(t, caCert, caKey)
	crt, key := filepath.Join(data, "server.crt"), filepath.Join(data, "server.key")
	require.NoError(t, os.WriteFile(crt, certPEM, 0o644))
	require.NoError(t, os.WriteFile(key, keyPEM, 0o600))
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		require.NoError(t, err)
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		require.NoError(t, os.Chown(crt, uid, gid))
		require.NoError(t, os.Chown(key, uid, gid))
	}
	admin, err := pgx.Connect(ctx, srv.Env)
	require.NoError(t, err)
	for _, q := range []string{
		`ALTER SYSTEM SET ssl_cert_file = '` + crt + `'`,
		`ALTER SYSTEM SET ssl_key_file = '` + key + `'`,
		`ALTER SYSTEM SET ssl = on`,
	} {
		_, err := admin.Exec(ctx, q)
		require.NoError(t, err, q)
	}
	require.NoError(t, admin.Close(ctx))
	// A restart (not a reload, which applies in the background) so TLS is
	// on when Start returns.
	require.NoError(t, srv.Stop())
	require.NoError(t, srv.Start())

	u, err := url.Parse(srv.Env)
	require.NoError(t, err)
	_, port, err := net.SplitHostPort(u.Host)
	require.NoError(t, err)
	const password = "pw-not-shown"
	dsn := func(host, rootCert string) string {
		return "postgres://postgres:" + password + "@" + net.JoinHostPort(host, port) + "/postgres?sslmode=verify-full&sslrootcert=" + url.QueryEscape(rootCert)
	}

	pool, err := pgconn.Open(ctx, dsn("127.0.0.1", caFile), 2)
	require.NoError(t, err)
	var ssl bool
	var version string
	require.NoError(t, pool.QueryRow(ctx, `SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()`).Scan(&ssl, &version))
	pool.Close()
	require.True(t, ssl)
	t.Logf("verify-full connected over %s", version)

	for _, tc := range []struct{ name, host, ca, want string }{
		{"untrusted CA", "127.0.0.1", otherFile, "unknown authority"},
		{"host name not in the certificate", "localhost", caFile, "localhost"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := pgconn.Open(ctx, dsn(tc.host, tc.ca), 2)
			require.Error(t, err)
			msg := err.Error()
			t.Log(msg)
			require.True(t, strings.HasPrefix(msg, "DATABASE_URL="), msg)
			require.Contains(t, msg, tc.want)
			require.NotContains(t, msg, password)
			require.NotContains(t, msg, "\n")
		})
	}
}

func newCA(t *testing.T, cn string) ([]byte, *x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), cert, key
}

func newServerCert(t *testing.T, ca *x509.Certificate, caKey *ecdsa.PrivateKey) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage:    x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	require.NoError(t, err)
	kb, err := x509.MarshalPKCS8PrivateKey(key)
	require.NoError(t, err)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kb})
}

// Giving an advisory lock back while the database stalls (its backend
// stopped with SIGSTOP, as a hung server or a lost network leaves it) returns
// within the unlock timeout with the session closed, instead of hanging the
// process's shutdown on an answer that never comes; the lock is free once the
// server goes on and sees the session gone.
func TestReleaseAdvisoryLockOnAStalledDatabase(t *testing.T) {
	ctx := context.Background()
	url := stack.Database(t)
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	const key = 0x72656c65617365
	var pid int
	require.NoError(t, conn.QueryRow(ctx, `SELECT pg_backend_pid() FROM (SELECT pg_advisory_lock($1)) AS locked`, key).Scan(&pid))
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	stopped := true
	resume := func() {
		if stopped {
			stopped = false
			require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
		}
	}
	defer resume()

	start := time.Now()
	done := make(chan error, 1)
	go func() { done <- pgconn.ReleaseAdvisoryLock(ctx, conn, key) }()
	select {
	case err := <-done:
		took := time.Since(start)
		t.Logf("returned after %s: %v", took.Round(time.Millisecond), err)
		require.Error(t, err, "a stopped server cannot have answered")
		require.Less(t, took, 20*time.Second)
	case <-time.After(30 * time.Second):
		resume()
		t.Fatal("ReleaseAdvisoryLock still waits for the stopped server after 30 s")
	}
	require.True(t, conn.IsClosed(), "the session is closed: the server releases its locks when it sees that")

	resume()
	went := time.Now()
	other, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer other.Close(ctx)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for deadline := time.Now().Add(30 * time.Second); ; <-tick.C {
		var free bool
		require.NoError(t, other.QueryRow(ctx, `SELECT pg_try_advisory_lock($1)`, key).Scan(&free))
		if free {
			t.Logf("lock free %s after the server went on", time.Since(went).Round(time.Millisecond))
			return
		}
		require.True(t, time.Now().Before(deadline), "the lock is still held 30 s after the server went on")
	}
}
