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

	searchOnce sync.Once
	search     *SecureSearch
	searchErr  error
)

// SecureSearch is the shared search engine behind nginx
// (scripts/stack/search-secure.sh): HTTPS endpoints that check basic auth,
// an API key or a client certificate.
type SecureSearch struct {
	*Server
	// Settings are the lines of secure.env: SEARCH_BASIC_URL,
	// SEARCH_APIKEY_URL, SEARCH_MTLS_URL, ELASTICSEARCH_CA_FILE,
	// ELASTICSEARCH_CERT_FILE/KEY_FILE, SEARCH_OTHER_CA_FILE,
	// SEARCH_OTHER_CERT_FILE/KEY_FILE, ELASTICSEARCH_USERNAME,
	// ELASTICSEARCH_PASSWORD, ELASTICSEARCH_API_KEY (id:key).
	Settings map[string]string
}

// SecuredSearch returns the secured endpoints of this test binary, started
// on first use in front of the shared engine and stopped by [Main].
func SecuredSearch(tb testing.TB) *SecureSearch {
	tb.Helper()
	upstream := ElasticsearchURL(tb)
	searchOnce.Do(func() {
		dir, err := os.MkdirTemp("", "outboxrelay-search-secure-")
		if err != nil {
			searchErr = err
			return
		}
		srv := &Server{Kind: "search-secure", Dir: dir, Vars: []string{"SEARCH_UPSTREAM=" + upstream}}
		if searchErr = srv.Start(); searchErr != nil {
			return
		}
		var settings map[string]string
		settings, searchErr = readEnvFile(filepath.Join(dir, "nginx", "secure.env"))
		search = &SecureSearch{Server: srv, Settings: settings}
	})
	if searchErr != nil {
		tb.Fatalf("start secured search endpoint: %v", searchErr)
	}
	return search
}

func readEnvFile(path string) (map[string]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	m := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok {
			m[k] = v
		}
	}
	return m, sc.Err()
}

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
		var settings map[string]string
		settings, secureErr = readEnvFile(filepath.Join(dir, "kafka", "secure.env"))
		secure = &SecureKafka{Server: srv, Settings: settings}
	})
	if secureErr != nil {
		tb.Fatalf("start secured kafka: %v", secureErr)
	}
	return secure
}
