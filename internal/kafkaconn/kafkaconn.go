// Package kafkaconn turns the Kafka security settings (KAFKA_TLS*,
// KAFKA_SASL_*) into what kafka-go needs to reach a secured cluster: a
// *tls.Config and a sasl.Mechanism, ready for a kafka.Transport (writers,
// clients) or a kafka.Dialer (readers). It also probes the brokers once at
// start, so a wrong password, an untrusted certificate or a missing setting
// ends the process within seconds with one line naming the setting, instead
// of a retry loop that hides it.
//
//	var ks kafkaconn.Settings
//	ks.Register(fs)               // flags + env, shown by --help
//	...
//	sec, err := ks.Build(logger)  // validate, read files
//	if err := sec.Probe(ctx, brokers); err != nil { ... }
//	w := &kafka.Writer{Transport: sec.Transport(&kafka.Transport{ClientID: "x"})}
//
// The zero Settings means a plaintext, unauthenticated cluster; Build then
// returns a Security whose TLS and SASL are nil.
package kafkaconn

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl"
	"github.com/segmentio/kafka-go/sasl/plain"
	"github.com/segmentio/kafka-go/sasl/scram"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/redact"
)

// Mechanism names accepted by KAFKA_SASL_MECHANISM (case-insensitive).
const (
	MechanismPlain    = "PLAIN"
	MechanismSHA256   = "SCRAM-SHA-256"
	MechanismSHA512   = "SCRAM-SHA-512"
	DefaultProbeLimit = 10 * time.Second
)

// Settings are the Kafka security settings of a binary. Every field is
// optional; the zero value is a plaintext connection without SASL.
type Settings struct {
	// TLS turns TLS on (KAFKA_TLS). Implied by any other KAFKA_TLS_* file.
	TLS bool
	// CAFile is a PEM bundle of the CAs that sign the brokers' certificates
	// (KAFKA_TLS_CA_FILE). Default: the system roots.
	CAFile string
	// CertFile and KeyFile are the PEM client certificate and key for mTLS
	// (KAFKA_TLS_CERT_FILE, KAFKA_TLS_KEY_FILE). Both or neither.
	CertFile, KeyFile string
	// InsecureSkipVerify disables verification of the broker's certificate
	// and name (KAFKA_TLS_INSECURE_SKIP_VERIFY). Default false; true is
	// logged as a warning at every start.
	InsecureSkipVerify bool
	// Mechanism is PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512
	// (KAFKA_SASL_MECHANISM). "" means no SASL.
	Mechanism string
	// Username and Password are the SASL credentials (KAFKA_SASL_USERNAME,
	// KAFKA_SASL_PASSWORD); each may instead be read from a file
	// (KAFKA_SASL_USERNAME_FILE, KAFKA_SASL_PASSWORD_FILE).
	Username, Password         string
	UsernameFile, PasswordFile string
	// RequireTLS (REQUIRE_TLS, shared with the other connections) refuses
	// a plaintext connection and KAFKA_TLS_INSECURE_SKIP_VERIFY.
	RequireTLS bool
	// requireFlag is the command's REQUIRE_TLS, bound by Register.
	requireFlag *bool
}

// Register adds the settings to fs as flags and environment variables.
func (s *Settings) Register(fs *cli.FlagSet) {
	fs.Bool(&s.TLS, "kafka-tls", "KAFKA_TLS", false, "connect to Kafka over TLS (implied by any --kafka-tls-*-file)")
	fs.String(&s.CAFile, "kafka-tls-ca-file", "KAFKA_TLS_CA_FILE", "", `PEM file of the CA(s) that sign the brokers' certificates ("" = system roots)`)
	fs.String(&s.CertFile, "kafka-tls-cert-file", "KAFKA_TLS_CERT_FILE", "", "PEM client certificate for mTLS (with --kafka-tls-key-file)")
	fs.SecretFile(&s.KeyFile, "kafka-tls-key-file", "KAFKA_TLS_KEY_FILE", "PEM private key of --kafka-tls-cert-file")
	fs.Bool(&s.InsecureSkipVerify, "kafka-tls-insecure-skip-verify", "KAFKA_TLS_INSECURE_SKIP_VERIFY", false, "DANGEROUS: accept any broker certificate and name (logged as a warning)")
	fs.String(&s.Mechanism, "kafka-sasl-mechanism", "KAFKA_SASL_MECHANISM", "", `SASL mechanism: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 ("" = no SASL)`)
	fs.String(&s.Username, "kafka-sasl-username", "KAFKA_SASL_USERNAME", "", "SASL user name")
	fs.String(&s.UsernameFile, "kafka-sasl-username-file", "KAFKA_SASL_USERNAME_FILE", "", "file holding the SASL user name (instead of --kafka-sasl-username)")
	fs.Secret(&s.Password, "kafka-sasl-password", "KAFKA_SASL_PASSWORD", "", "SASL password (prefer --kafka-sasl-password-file)")
	fs.SecretFile(&s.PasswordFile, "kafka-sasl-password-file", "KAFKA_SASL_PASSWORD_FILE", "file holding the SASL password (Docker/Kubernetes secret)")
	s.requireFlag = fs.RequireTLS()
}

// Security is what a Kafka construction site needs: nil fields mean
// plaintext / no SASL.
type Security struct {
	TLS  *tls.Config
	SASL sasl.Mechanism
	// describe is "plaintext", "TLS", "SASL_SSL SCRAM-SHA-512 as alice", …
	// for log lines and errors; never a secret.
	describe string
	log      *slog.Logger
}

// String describes the connection without secrets.
func (s *Security) String() string {
	if s == nil || s.describe == "" {
		return "plaintext"
	}
	return s.describe
}

// Transport sets TLS and SASL on t and returns it, for
// kafka.Writer.Transport or kafka.Client.Transport. A nil Security leaves t
// as it is (plaintext).
func (s *Security) Transport(t *kafka.Transport) *kafka.Transport {
	if s != nil {
		t.TLS, t.SASL = s.TLS, s.SASL
	}
	return t
}

// Dialer returns a kafka.Dialer (for kafka.ReaderConfig.Dialer) with
// kafka-go's default timeout and TLS and SASL set.
func (s *Security) Dialer() *kafka.Dialer {
	d := &kafka.Dialer{Timeout: 10 * time.Second, DualStack: true}
	if s != nil {
		d.TLS, d.SASLMechanism = s.TLS, s.SASL
	}
	return d
}

// Build validates the settings, reads the files they name and returns the
// Security to pass to the Kafka construction sites. Errors name the
// setting (and never print a secret); they are usage errors (exit 2).
func (s Settings) Build(logger *slog.Logger) (*Security, error) {
	sec := &Security{log: logger}
	useTLS := s.TLS || s.CAFile != "" || s.CertFile != "" || s.KeyFile != "" || s.InsecureSkipVerify
	if s.RequireTLS || (s.requireFlag != nil && *s.requireFlag) {
		switch {
		case !useTLS:
			return nil, cli.UsageError("REQUIRE_TLS=true: Kafka is plaintext: set KAFKA_TLS=true (and KAFKA_TLS_CA_FILE unless the system roots sign the brokers' certificates) and use their TLS listener")
		case s.InsecureSkipVerify:
			return nil, cli.UsageError("REQUIRE_TLS=true: KAFKA_TLS_INSECURE_SKIP_VERIFY=true does not verify the brokers: unset it and set KAFKA_TLS_CA_FILE to the CA that signs their certificates")
		}
	}
	var parts []string
	if useTLS {
		cfg, err := s.tlsConfig()
		if err != nil {
			return nil, err
		}
		sec.TLS = cfg
		if s.InsecureSkipVerify && logger != nil {
			logger.Warn("KAFKA_TLS_INSECURE_SKIP_VERIFY=true: the brokers' certificates and names are NOT verified; anyone on the path can read and change the traffic")
		}
	}
	mech, user, err := s.mechanism()
	if err != nil {
		return nil, err
	}
	sec.SASL = mech
	if mech != nil && !useTLS && logger != nil {
		logger.Warn("KAFKA_SASL_MECHANISM=" + mech.Name() + " without KAFKA_TLS: the SASL exchange (with PLAIN, the password itself) and every message cross the network in clear; set KAFKA_TLS=true and use the brokers' SASL_SSL listener")
	}
	switch {
	case useTLS && mech != nil:
		parts = append(parts, "SASL_SSL")
	case useTLS:
		parts = append(parts, "SSL")
	case mech != nil:
		parts = append(parts, "SASL_PLAINTEXT")
	default:
		parts = append(parts, "plaintext")
	}
	if mech != nil {
		parts = append(parts, mech.Name(), "as", user)
	}
	if sec.TLS != nil && len(sec.TLS.Certificates) > 0 {
		parts = append(parts, "with client certificate")
	}
	sec.describe = strings.Join(parts, " ")
	return sec, nil
}

func (s Settings) tlsConfig() (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: s.InsecureSkipVerify} //nolint:gosec // opt-in, logged as a warning
	if s.CAFile != "" {
		pem, err := os.ReadFile(s.CAFile)
		if err != nil {
			return nil, cli.UsageError("KAFKA_TLS_CA_FILE=%q: %v", s.CAFile, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, cli.UsageError("KAFKA_TLS_CA_FILE=%q: no PEM certificate in the file", s.CAFile)
		}
		cfg.RootCAs = pool
	}
	switch {
	case s.CertFile != "" && s.KeyFile != "":
		cert, err := tls.LoadX509KeyPair(s.CertFile, s.KeyFile)
		if err != nil {
			return nil, cli.UsageError("KAFKA_TLS_CERT_FILE=%q / KAFKA_TLS_KEY_FILE=%q: %v", s.CertFile, s.KeyFile, err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	case s.CertFile != "":
		return nil, cli.UsageError("KAFKA_TLS_CERT_FILE is set but KAFKA_TLS_KEY_FILE is not: set both for a client certificate")
	case s.KeyFile != "":
		return nil, cli.UsageError("KAFKA_TLS_KEY_FILE is set but KAFKA_TLS_CERT_FILE is not: set both for a client certificate")
	}
	return cfg, nil
}

func (s Settings) mechanism() (sasl.Mechanism, string, error) {
	user, err := valueOrFile("KAFKA_SASL_USERNAME", s.Username, s.UsernameFile)
	if err != nil {
		return nil, "", err
	}
	pass, err := valueOrFile("KAFKA_SASL_PASSWORD", s.Password, s.PasswordFile)
	if err != nil {
		return nil, "", err
	}
	redact.Add(pass) // masked in every log line and error from now on
	name := strings.ToUpper(strings.TrimSpace(s.Mechanism))
	if name == "" {
		if user != "" || pass != "" {
			return nil, "", cli.UsageError("KAFKA_SASL_USERNAME/KAFKA_SASL_PASSWORD are set but KAFKA_SASL_MECHANISM is not: set it to PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512")
		}
		return nil, "", nil
	}
	if user == "" {
		return nil, "", cli.UsageError("KAFKA_SASL_MECHANISM=%s needs KAFKA_SASL_USERNAME (or KAFKA_SASL_USERNAME_FILE)", name)
	}
	if pass == "" {
		return nil, "", cli.UsageError("KAFKA_SASL_MECHANISM=%s needs KAFKA_SASL_PASSWORD (or KAFKA_SASL_PASSWORD_FILE)", name)
	}
	switch name {
	case MechanismPlain:
		return plain.Mechanism{Username: user, Password: pass}, user, nil
	case MechanismSHA256, MechanismSHA512:
		algo := scram.SHA256
		if name == MechanismSHA512 {
			algo = scram.SHA512
		}
		m, err := scram.Mechanism(algo, user, pass)
		if err != nil {
			return nil, "", cli.UsageError("KAFKA_SASL_USERNAME/KAFKA_SASL_PASSWORD: %v", err)
		}
		return m, user, nil
	default:
		return nil, "", cli.UsageError("KAFKA_SASL_MECHANISM=%q: want PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512", s.Mechanism)
	}
}

// valueOrFile returns the value of setting NAME, given directly or as the
// content of NAME_FILE (one trailing newline removed). Both at once is an
// error: which one wins would be a guess.
func valueOrFile(name, value, file string) (string, error) {
	if file == "" {
		return value, nil
	}
	if value != "" {
		return "", cli.UsageError("%s and %s_FILE are both set: set one", name, name)
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return "", cli.UsageError("%s_FILE=%q: %v", name, file, err)
	}
	return strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), "\r"), nil
}

// Probe sends one metadata request to the brokers with a short timeout and
// turns a failure that configuration caused (a credential, a certificate,
// a security protocol that does not match the listener) into one line that
// names the setting to fix (see [Classify]). Call it at start, before
// anything reads or writes. A broker that is down or slow is not an error
// here: it is logged, and the caller's own retries wait for it.
func (s *Security) Probe(ctx context.Context, brokers []string) error {
	ctx, cancel := context.WithTimeout(ctx, DefaultProbeLimit)
	defer cancel()
	t := s.Transport(&kafka.Transport{DialTimeout: 5 * time.Second, ClientID: "outboxrelay-probe"})
	defer t.CloseIdleConnections()
	c := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: DefaultProbeLimit, Transport: t}
	var (
		err       error
		hint      string
		permanent bool
	)
	// A listener whose security protocol does not match closes the
	// connection, and so, once, may a broker that is shutting down: a
	// closed connection counts as a mismatch only when it happens again.
	for attempt := 1; ; attempt++ {
		_, err = c.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{}})
		if err == nil {
			return nil
		}
		hint, permanent = Classify(err)
		if permanent || !closedEarly(err) || ctx.Err() != nil {
			break
		}
		if attempt == 3 {
			permanent = true
			break
		}
		if s != nil && s.log != nil {
			s.log.Debug("kafka probe: broker closed the connection; trying again", slog.Int("attempt", attempt))
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(attempt) * 500 * time.Millisecond):
		}
	}
	perr := &ProbeError{Brokers: strings.Join(brokers, ","), Security: s.String(), Hint: hint, Err: err}
	if permanent {
		return perr
	}
	if s != nil && s.log != nil {
		s.log.Warn("kafka not reachable at start; going on, the brokers may still be starting", slog.String("error", perr.Error()))
	}
	return nil
}

// ProbeError is a failed start-up probe. Its message is one line: what
// failed, the setting to look at, and the underlying error.
type ProbeError struct {
	Brokers  string
	Security string
	Hint     string
	Err      error
}

func (e *ProbeError) Error() string {
	cause := strings.ReplaceAll(e.Err.Error(), "\n", " ")
	return fmt.Sprintf("kafka %s (%s): %s: %s", e.Brokers, e.Security, e.Hint, cause)
}

func (e *ProbeError) Unwrap() error { return e.Err }

// Classify names what a failed connection most likely needs fixed, and
// whether retrying cannot help (a credential, a certificate, a protocol
// mismatch) as opposed to a broker that is down or slow. It looks at error
// types and codes, never at message strings.
func Classify(err error) (hint string, permanent bool) {
	var (
		unknownCA x509.UnknownAuthorityError
		hostname  x509.HostnameError
		invalid   x509.CertificateInvalidError
		record    tls.RecordHeaderError
		op        *net.OpError
		kerr      kafka.Error
	)
	switch {
	case errors.Is(err, kafka.SASLAuthenticationFailed):
		return "SASL authentication failed: check KAFKA_SASL_USERNAME / KAFKA_SASL_PASSWORD and KAFKA_SASL_MECHANISM", true
	case errors.Is(err, kafka.UnsupportedSASLMechanism):
		return "the broker does not accept this SASL mechanism: check KAFKA_SASL_MECHANISM", true
	case errors.Is(err, kafka.IllegalSASLState):
		return "the listener expects SASL: set KAFKA_SASL_MECHANISM, KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD", true
	case errors.As(err, &unknownCA):
		return "broker certificate signed by an unknown authority: set KAFKA_TLS_CA_FILE to the CA that signed it", true
	case errors.As(err, &hostname):
		return "broker certificate is not valid for this host name: use the name in the certificate in KAFKA_BROKERS", true
	case errors.As(err, &invalid):
		return "broker certificate is invalid (expired or not for server use): check the broker's certificate and KAFKA_TLS_CA_FILE", true
	case errors.As(err, &record):
		return "the broker did not answer TLS: this listener is plaintext; unset KAFKA_TLS or use the TLS listener's port", true
	case errors.As(err, &op) && op.Op == "remote error": // crypto/tls's Op for an alert from the peer
		return "the broker refused the TLS handshake: it may require a client certificate (KAFKA_TLS_CERT_FILE / KAFKA_TLS_KEY_FILE) or not trust the one given", true
	case errors.Is(err, syscall.ECONNREFUSED):
		return "connection refused: check KAFKA_BROKERS (host and port)", false
	case closedEarly(err):
		return "the broker closed the connection: KAFKA_TLS and KAFKA_SASL_MECHANISM must match the listener's security protocol (SASL_SSL needs both, SSL only KAFKA_TLS, PLAINTEXT neither)", false
	case errors.Is(err, context.DeadlineExceeded), isTimeout(err):
		return "no answer in time: check KAFKA_BROKERS and that KAFKA_TLS matches the listener (TLS to a plaintext port, or plaintext to a TLS port, hangs)", false
	case errors.As(err, &kerr):
		return "the broker refused the request (" + kerr.Title() + ")", false
	default:
		return "cannot reach the brokers: check KAFKA_BROKERS and the KAFKA_TLS*/KAFKA_SASL_* settings", false
	}
}

// closedEarly: the broker hung up before answering, which is what a
// listener does with a client of another security protocol.
func closedEarly(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
