package stack

import (
	"bufio"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// SecureKafka is a private broker started by scripts/stack/kafka-secure.sh:
// the plaintext listener (Server.Env) plus a SASL_SSL listener (PLAIN,
// SCRAM-SHA-256, SCRAM-SHA-512) and an SSL listener that requires client
// certificates, with the files and credentials to reach them.
type SecureKafka struct {
	*Server
	// Settings are the lines of secure.env: KAFKA_SASL_SSL_BROKERS,
	// KAFKA_SSL_BROKERS, KAFKA_TLS_CA_FILE, KAFKA_TLS_CERT_FILE,
	// KAFKA_TLS_KEY_FILE, KAFKA_OTHER_CA_FILE (an untrusted CA),
	// KAFKA_OTHER_CERT_FILE/KEY_FILE (a client certificate of that CA),
	// KAFKA_SASL_USERNAME, KAFKA_SASL_PASSWORD.
	Settings map[string]string
}

var (
	secureOnce sync.Once
	secure     *SecureKafka
	secureErr  error
)

// SecuredKafka returns the secured broker of this test binary, started on
// first use and stopped by [Main]. Tests share it (unique topic names);
// none may stop it.
func SecuredKafka(tb testing.TB) *SecureKafka {
	tb.Helper()
	skipShort(tb, "kafka-secure")
	secureOnce.Do(func() {
		dir, err := os.MkdirTemp("", "outboxrelay-secure-")
		if err != nil {
			secureErr = err
			return
		}
		srv := &Server{Kind: "kafka-secure", Dir: dir}
		if secureErr = srv.Start(); secureErr != nil {
			return
		}
		s := &SecureKafka{Server: srv, Settings: map[string]string{}}
		f, err := os.Open(filepath.Join(dir, "kafka", "secure.env"))
		if err != nil {
			secureErr = err
			return
		}
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), "="); ok {
				s.Settings[k] = v
			}
		}
		secure, secureErr = s, sc.Err()
	})
	if secureErr != nil {
		tb.Fatalf("start secured kafka: %v", secureErr)
	}
	return secure
}
