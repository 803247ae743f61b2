package cli

import (
	"os"
	"strings"

	"github.com/outboxrelay/outboxrelay/internal/metrics"
)

// Metrics holds the settings of a service's /metrics, /healthz and /readyz
// endpoint.
type Metrics struct {
	// Addr is the listen address (default: 127.0.0.1:<the service's port>,
	// loopback only; "" disables the endpoint).
	Addr string
	// Username and Password require HTTP basic auth on /metrics and /readyz
	// when set (default: none). PasswordFile is read instead of Password when set.
	Username, Password, PasswordFile string
}

// RegisterMetrics adds METRICS_ADDR (default defaultAddr), METRICS_USERNAME,
// METRICS_PASSWORD and METRICS_PASSWORD_FILE.
func (m *Metrics) RegisterMetrics(fs *FlagSet, defaultAddr string) {
	fs.String(&m.Addr, "metrics-addr", "METRICS_ADDR", defaultAddr, `address for /metrics, /healthz and /readyz ("" disables; 0.0.0.0:PORT for a remote Prometheus)`)
	fs.String(&m.Username, "metrics-username", "METRICS_USERNAME", "", "require HTTP basic auth with this user on /metrics and /readyz (with METRICS_PASSWORD or METRICS_PASSWORD_FILE; /healthz stays open)")
	fs.Secret(&m.Password, "metrics-password", "METRICS_PASSWORD", "", "password of METRICS_USERNAME")
	fs.SecretFile(&m.PasswordFile, "metrics-password-file", "METRICS_PASSWORD_FILE", "file holding the password of METRICS_USERNAME (instead of METRICS_PASSWORD)")
}

// Endpoint checks the settings and returns what metrics.Serve needs.
func (m *Metrics) Endpoint() (metrics.Endpoint, error) {
	ep := metrics.Endpoint{Addr: m.Addr, Username: m.Username, Password: m.Password}
	if m.PasswordFile != "" {
		if m.Password != "" {
			return ep, UsageError("METRICS_PASSWORD and METRICS_PASSWORD_FILE: set one, not both")
		}
		b, err := os.ReadFile(m.PasswordFile)
		if err != nil {
			return ep, UsageError("METRICS_PASSWORD_FILE=%q: %v", m.PasswordFile, err)
		}
		ep.Password = strings.TrimRight(string(b), "\r\n")
		if ep.Password == "" {
			return ep, UsageError("METRICS_PASSWORD_FILE=%q: the file is empty", m.PasswordFile)
		}
	}
	if (ep.Username == "") != (ep.Password == "") {
		return ep, UsageError("METRICS_USERNAME and METRICS_PASSWORD (or METRICS_PASSWORD_FILE): set both or neither")
	}
	return ep, nil
}
