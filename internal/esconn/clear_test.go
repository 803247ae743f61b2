package esconn_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"log/slog"
	"math/big"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/esconn"
)

// Credentials over http:// go in clear: the start-up probe says so,
// naming the setting and never the secret. Without credentials, or over
// https, nothing is said.
func TestCredentialsOverHTTPAreLogged(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte(`{}`)) }))
	defer srv.Close()
	host := srv.Listener.Addr().String()
	for _, tc := range []struct {
		name, url string
		s         esconn.Settings
		want      string
	}{
		{"basic auth in the URL", "http://elastic:s3cret@" + host, esconn.Settings{}, "basic auth over http://"},
		{"basic auth settings", srv.URL, esconn.Settings{Username: "elastic", Password: "s3cret"}, "basic auth over http://"},
		{"API key", srv.URL, esconn.Settings{APIKey: "id:s3cret"}, "API key over http://"},
		{"no credentials", srv.URL, esconn.Settings{}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs bytes.Buffer
			conn, err := tc.s.Build(tc.url)
			require.NoError(t, err)
			require.NoError(t, conn.Probe(context.Background(), slog.New(slog.NewTextHandler(&logs, nil))))
			if tc.want == "" {
				require.Empty(t, logs.String())
				return
			}
			require.Contains(t, logs.String(), "level=WARN")
			require.Contains(t, logs.String(), tc.want)
			require.Contains(t, logs.String(), "ELASTICSEARCH_URL")
			require.NotContains(t, logs.String(), "s3cret")
		})
	}
}

// TLS settings with a plain http:// node would be silently ignored (no
// TLS, no certificate checked, no client certificate sent): an error that
// names the settings and the node.
func TestTLSSettingsWithHTTPAreAnError(t *testing.T) {
	t.Parallel()
	cert, key := selfSigned(t)
	for _, tc := range []struct {
		name, url string
		s         esconn.Settings
		want      string
	}{
		{"CA", "http://h:9200", esconn.Settings{CAFile: cert}, "ELASTICSEARCH_CA_FILE is set but ELASTICSEARCH_URL http://h:9200 is not https"},
		{"client certificate, one node of two", "https://a:9200,http://b:9200", esconn.Settings{CertFile: cert, KeyFile: key},
			"ELASTICSEARCH_CERT_FILE/ELASTICSEARCH_KEY_FILE is set but ELASTICSEARCH_URL http://b:9200 is not https"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tc.s.Build(tc.url)
			require.ErrorContains(t, err, tc.want)
		})
	}
	_, err := esconn.Settings{CAFile: cert, CertFile: cert, KeyFile: key}.Build("https://a:9200,https://b:9200")
	require.NoError(t, err)
}

// selfSigned writes a self-signed CA certificate and its key as PEM files.
func selfSigned(t *testing.T) (certFile, keyFile string) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test"}, NotBefore: time.Now().Add(-time.Hour),
		NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
	require.NoError(t, err)
	kder, err := x509.MarshalECPrivateKey(k)
	require.NoError(t, err)
	dir := t.TempDir()
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	require.NoError(t, os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600))
	require.NoError(t, os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600))
	return certFile, keyFile
}

// REQUIRE_TLS refuses any http:// node, and accepts https ones.
func TestRequireTLS(t *testing.T) {
	t.Parallel()
	cert, _ := selfSigned(t)
	_, err := esconn.Settings{RequireTLS: true}.Build("https://a:9200,http://b:9200")
	require.ErrorContains(t, err, "REQUIRE_TLS=true: ELASTICSEARCH_URL http://b:9200 is not https")
	_, err = esconn.Settings{RequireTLS: true}.Build("http://u:s3cret@a:9200")
	require.ErrorContains(t, err, "REQUIRE_TLS=true: ELASTICSEARCH_URL http://a:9200 is not https")
	require.NotContains(t, err.Error(), "s3cret")
	_, err = esconn.Settings{RequireTLS: true, CAFile: cert}.Build("https://a:9200,https://b:9200")
	require.NoError(t, err)
}
