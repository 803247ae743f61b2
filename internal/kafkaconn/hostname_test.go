package kafkaconn_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/kafkaconn"
	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// A broker whose certificate, signed by the trusted CA, names another host
// than the one dialed is refused with a line that says so; only
// KAFKA_TLS_INSECURE_SKIP_VERIFY lets it through, with a warning.
func TestBrokerCertificateMustNameTheHost(t *testing.T) {
	t.Parallel()
	caFile, cert := certificateFor(t, "kafka-1.other.example")
	addr := tlsProxy(t, cert, stack.KafkaBrokers(t)[0])

	sec, err := kafkaconn.Settings{CAFile: caFile}.Build(nil)
	require.NoError(t, err)
	start := time.Now()
	err = sec.Probe(context.Background(), []string{addr})
	require.Error(t, err)
	require.Less(t, time.Since(start), kafkaconn.DefaultProbeLimit)
	var pe *kafkaconn.ProbeError
	require.ErrorAs(t, err, &pe)
	var hostErr x509.HostnameError
	require.ErrorAs(t, err, &hostErr)
	require.Contains(t, err.Error(), "not valid for this host name")
	require.Contains(t, err.Error(), "KAFKA_BROKERS")
	require.NotContains(t, err.Error(), "\n")
	t.Logf("refused: %v", err)
	_, err = sec.Dialer().DialContext(context.Background(), "tcp", addr)
	require.ErrorAs(t, err, &hostErr, "the readers' dialer verifies the name too")

	// A certificate that names 127.0.0.1, made the same way, is accepted:
	// the refusal above is the name, not the chain.
	caFile2, cert2 := certificateFor(t, "127.0.0.1")
	sec2, err := kafkaconn.Settings{CAFile: caFile2}.Build(nil)
	require.NoError(t, err)
	require.NoError(t, sec2.Probe(context.Background(), []string{tlsProxy(t, cert2, stack.KafkaBrokers(t)[0])}))

	var logs bytes.Buffer
	insecure, err := kafkaconn.Settings{CAFile: caFile, InsecureSkipVerify: true}.Build(slog.New(slog.NewTextHandler(&logs, nil)))
	require.NoError(t, err)
	require.Contains(t, logs.String(), "level=WARN")
	require.Contains(t, logs.String(), "KAFKA_TLS_INSECURE_SKIP_VERIFY=true")
	conn, err := insecure.Dialer().DialContext(context.Background(), "tcp", addr)
	require.NoError(t, err, "the opt-out accepts a certificate for another name")
	defer conn.Close()
	_, err = conn.ApiVersions() // a real Kafka exchange through the TLS connection
	require.NoError(t, err)
}

// certificateFor makes a CA (written to a file) and a server certificate
// it signs for name (a DNS name or an IP address).
func certificateFor(t *testing.T, name string) (caFile string, cert tls.Certificate) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "outboxrelay test broker CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	require.NoError(t, err)
	caCert, err := x509.ParseCertificate(caDER)
	require.NoError(t, err)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	if ip := net.ParseIP(name); ip != nil {
		tmpl.IPAddresses = []net.IP{ip}
	} else {
		tmpl.DNSNames = []string{name}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	require.NoError(t, err)
	caFile = filepath.Join(t.TempDir(), "ca.pem")
	require.NoError(t, os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), 0o600))
	return caFile, tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// tlsProxy serves TLS with cert on a loopback port and relays each
// connection to the plaintext broker at upstream, so the Kafka exchange
// behind the handshake is real.
func tlsProxy(t *testing.T, cert tls.Certificate, upstream string) string {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12})
	require.NoError(t, err)
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns []net.Conn
	)
	track := func(c net.Conn) {
		mu.Lock()
		defer mu.Unlock()
		conns = append(conns, c)
	}
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			track(c)
			up, err := net.Dial("tcp", upstream)
			if err != nil {
				c.Close()
				continue
			}
			track(up)
			wg.Add(2)
			relay := func(dst, src net.Conn) {
				defer wg.Done()
				_, _ = io.Copy(dst, src)
				dst.Close()
				src.Close()
			}
			go relay(up, c)
			go relay(c, up)
		}
	}()
	return ln.Addr().String()
}
