// Package esconn turns the search engine security settings (basic auth, an
// API key, TLS with a custom CA and client certificates) into the
// *http.Client the olivere/elastic client uses, and probes the engine once
// at start so a wrong password or an untrusted certificate ends the process
// within seconds with one line naming the setting.
//
//	var es esconn.Settings
//	es.Register(fs)
//	...
//	conn, err := es.Build(rawURL) // user:password@ in the URL is accepted
//	if err := conn.Probe(ctx, logger); err != nil { ... } // also logs Warnings
//	client, err := index.NewClientWith(conn.URL, conn.HTTP)
package esconn

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"strings"
	"syscall"
	"time"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/redact"
)

// ProbeLimit bounds the start-up probe.
const ProbeLimit = 10 * time.Second

// Settings are the search engine security settings. All optional.
type Settings struct {
	// Username and Password are HTTP basic auth (ELASTICSEARCH_USERNAME,
	// ELASTICSEARCH_PASSWORD or ELASTICSEARCH_PASSWORD_FILE). User info in
	// ELASTICSEARCH_URL is the same thing; setting both is an error.
	Username, Password, PasswordFile string
	// APIKey is sent as "Authorization: ApiKey <key>" (ELASTICSEARCH_API_KEY
	// or ELASTICSEARCH_API_KEY_FILE): either the base64 "encoded" value the
	// create-API-key call returns, or "id:api_key", encoded here.
	APIKey, APIKeyFile string
	// CAFile is a PEM bundle of the CAs that sign the engine's certificate
	// (ELASTICSEARCH_CA_FILE). Default: the system roots.
	CAFile string
	// CertFile and KeyFile are a PEM client certificate and key
	// (ELASTICSEARCH_CERT_FILE, ELASTICSEARCH_KEY_FILE). Both or neither.
	CertFile, KeyFile string
	// RequireTLS (REQUIRE_TLS, shared with the other connections) refuses
	// an http:// node.
	RequireTLS bool
	// requireFlag is the command's REQUIRE_TLS, bound by Register.
	requireFlag *bool
}

// Register adds the settings to fs.
func (s *Settings) Register(fs *cli.FlagSet) {
	fs.String(&s.Username, "elasticsearch-username", "ELASTICSEARCH_USERNAME", "", "basic auth user for the search engine (or user info in ELASTICSEARCH_URL)")
	fs.Secret(&s.Password, "elasticsearch-password", "ELASTICSEARCH_PASSWORD", "", "basic auth password (prefer --elasticsearch-password-file)")
	fs.SecretFile(&s.PasswordFile, "elasticsearch-password-file", "ELASTICSEARCH_PASSWORD_FILE", "file holding the basic auth password (Docker/Kubernetes secret)")
	fs.Secret(&s.APIKey, "elasticsearch-api-key", "ELASTICSEARCH_API_KEY", "", `API key sent as "Authorization: ApiKey …" (the encoded value, or id:api_key)`)
	fs.SecretFile(&s.APIKeyFile, "elasticsearch-api-key-file", "ELASTICSEARCH_API_KEY_FILE", "file holding the API key")
	fs.String(&s.CAFile, "elasticsearch-ca-file", "ELASTICSEARCH_CA_FILE", "", `PEM file of the CA(s) that sign the engine's certificate ("" = system roots)`)
	fs.String(&s.CertFile, "elasticsearch-cert-file", "ELASTICSEARCH_CERT_FILE", "", "PEM client certificate (with --elasticsearch-key-file)")
	fs.SecretFile(&s.KeyFile, "elasticsearch-key-file", "ELASTICSEARCH_KEY_FILE", "PEM private key of --elasticsearch-cert-file")
	s.requireFlag = fs.RequireTLS()
}

// Conn is what the search engine client needs.
type Conn struct {
	// URL is ELASTICSEARCH_URL without its user info: one address, or
	// several nodes' addresses comma-separated (index.NewClient takes both).
	URL string
	// urls are URL's addresses.
	urls []string
	// HTTP sends the credentials and uses the TLS settings.
	HTTP *http.Client
	// describe names the authentication for errors, never a secret.
	describe string
	// warnings are logged by Probe: settings that work but are unsafe.
	warnings []string
}

// Warnings are the settings that work but are unsafe (credentials over
// http://), one line each, without secrets. Probe logs them.
func (c *Conn) Warnings() []string { return c.warnings }

// Build validates the settings and returns the connection for rawURL, one
// address or a comma-separated list of a cluster's nodes. Errors are usage
// errors that name the setting; none shows a secret.
func (s Settings) Build(rawURL string) (*Conn, error) {
	var (
		urls     []*url.URL
		userInfo *url.Userinfo
		err      error
	)
	for _, raw := range splitURLs(rawURL) {
		raw = strings.TrimSpace(raw)
		u, perr := url.Parse(raw)
		if perr != nil || u.Scheme == "" || u.Host == "" {
			return nil, cli.UsageError("ELASTICSEARCH_URL=%q: want a URL such as https://127.0.0.1:9200, or several nodes' URLs separated by commas", redact.URL(raw))
		}
		// A ',' in an unescaped password splits the list inside the user
		// info: the piece after it is no node URL (and the pieces joined
		// again would print the password).
		if u.Scheme != "http" && u.Scheme != "https" {
			return nil, cli.UsageError("ELASTICSEARCH_URL=%q: a node URL starts with http:// or https:// (percent-encode ',' in the user info, or set ELASTICSEARCH_USERNAME and ELASTICSEARCH_PASSWORD_FILE)", redact.URL(raw))
		}
		// An unescaped '#', '?' or '/' in the password makes url.Parse
		// read "user:" as the host and the rest as a fragment, a query
		// or a path: the URL would name another host and be printed
		// with the password.
		if strings.Contains(raw, "#") || strings.Contains(u.RawQuery, "@") || strings.Contains(u.Path, "@") {
			return nil, cli.UsageError("ELASTICSEARCH_URL=%q: percent-encode '#', '?', '/' and '@' in the user info (or set ELASTICSEARCH_USERNAME and ELASTICSEARCH_PASSWORD_FILE); a node URL has no fragment", redact.URL(raw))
		}
		if u.User != nil {
			if userInfo != nil && userInfo.String() != u.User.String() {
				return nil, cli.UsageError("ELASTICSEARCH_URL lists nodes with different user info: give the credentials once (ELASTICSEARCH_USERNAME/PASSWORD)")
			}
			userInfo = u.User
			u.User = nil
		}
		urls = append(urls, u)
	}
	user, pass := s.Username, s.Password
	if s.PasswordFile != "" {
		if pass != "" {
			return nil, cli.UsageError("ELASTICSEARCH_PASSWORD and ELASTICSEARCH_PASSWORD_FILE are both set: set one")
		}
		if pass, err = readSecret("ELASTICSEARCH_PASSWORD_FILE", s.PasswordFile); err != nil {
			return nil, err
		}
	}
	if userInfo != nil {
		if user != "" || pass != "" {
			return nil, cli.UsageError("ELASTICSEARCH_URL has user info and ELASTICSEARCH_USERNAME/PASSWORD are set too: use one")
		}
		user = userInfo.Username()
		pass, _ = userInfo.Password()
	}
	apiKey := s.APIKey
	if s.APIKeyFile != "" {
		if apiKey != "" {
			return nil, cli.UsageError("ELASTICSEARCH_API_KEY and ELASTICSEARCH_API_KEY_FILE are both set: set one")
		}
		if apiKey, err = readSecret("ELASTICSEARCH_API_KEY_FILE", s.APIKeyFile); err != nil {
			return nil, err
		}
	}
	redact.Add(pass, apiKey)
	if strings.Contains(apiKey, ":") {
		apiKey = base64.StdEncoding.EncodeToString([]byte(apiKey))
		redact.Add(apiKey)
	}
	var auth, describe string
	switch {
	case apiKey != "" && (user != "" || pass != ""):
		return nil, cli.UsageError("ELASTICSEARCH_API_KEY and basic auth (ELASTICSEARCH_USERNAME/PASSWORD or user info in ELASTICSEARCH_URL) are both set: use one")
	case apiKey != "":
		auth, describe = "ApiKey "+apiKey, "API key"
	case user != "" && pass == "":
		return nil, cli.UsageError("ELASTICSEARCH_USERNAME=%s needs ELASTICSEARCH_PASSWORD (or ELASTICSEARCH_PASSWORD_FILE)", user)
	case user == "" && pass != "":
		return nil, cli.UsageError("ELASTICSEARCH_PASSWORD is set but ELASTICSEARCH_USERNAME is not")
	case user != "":
		auth, describe = "Basic "+base64.StdEncoding.EncodeToString([]byte(user+":"+pass)), "basic auth as "+user
	default:
		describe = "no authentication"
	}

	var plain []string // the http:// nodes
	for _, u := range urls {
		if !strings.EqualFold(u.Scheme, "https") {
			plain = append(plain, u.String())
		}
	}
	if len(plain) > 0 && (s.RequireTLS || (s.requireFlag != nil && *s.requireFlag)) {
		return nil, cli.UsageError("REQUIRE_TLS=true: ELASTICSEARCH_URL %s is not https: use https:// (with ELASTICSEARCH_CA_FILE unless the system roots sign the engine's certificate)", strings.Join(plain, ","))
	}
	if len(plain) > 0 {
		// TLS settings would be ignored for these nodes.
		var tlsSet []string
		if s.CAFile != "" {
			tlsSet = append(tlsSet, "ELASTICSEARCH_CA_FILE")
		}
		if s.CertFile != "" || s.KeyFile != "" {
			tlsSet = append(tlsSet, "ELASTICSEARCH_CERT_FILE/ELASTICSEARCH_KEY_FILE")
		}
		if len(tlsSet) > 0 {
			return nil, cli.UsageError("%s is set but ELASTICSEARCH_URL %s is not https: use https:// (the TLS settings would be ignored) or unset them", strings.Join(tlsSet, " and "), plain[0])
		}
	}
	var warnings []string
	if auth != "" && len(plain) > 0 {
		what := "basic auth"
		if apiKey != "" {
			what = "API key"
		}
		warnings = append(warnings, fmt.Sprintf("%s over http:// (ELASTICSEARCH_URL %s): the credentials and documents cross the network in clear; use https://", what, strings.Join(plain, ",")))
	}

	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = 64
	if s.CAFile != "" || s.CertFile != "" || s.KeyFile != "" {
		cfg := &tls.Config{MinVersion: tls.VersionTLS12}
		if s.CAFile != "" {
			pem, err := os.ReadFile(s.CAFile)
			if err != nil {
				return nil, cli.UsageError("ELASTICSEARCH_CA_FILE=%q: %v", s.CAFile, err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(pem) {
				return nil, cli.UsageError("ELASTICSEARCH_CA_FILE=%q: no PEM certificate in the file", s.CAFile)
			}
			cfg.RootCAs = pool
		}
		switch {
		case s.CertFile != "" && s.KeyFile != "":
			cert, err := tls.LoadX509KeyPair(s.CertFile, s.KeyFile)
			if err != nil {
				return nil, cli.UsageError("ELASTICSEARCH_CERT_FILE=%q / ELASTICSEARCH_KEY_FILE=%q: %v", s.CertFile, s.KeyFile, err)
			}
			cfg.Certificates = []tls.Certificate{cert}
			describe += " with client certificate"
		case s.CertFile != "":
			return nil, cli.UsageError("ELASTICSEARCH_CERT_FILE is set but ELASTICSEARCH_KEY_FILE is not: set both")
		case s.KeyFile != "":
			return nil, cli.UsageError("ELASTICSEARCH_KEY_FILE is set but ELASTICSEARCH_CERT_FILE is not: set both")
		}
		tr.TLSClientConfig = cfg
	}
	nodes := map[string]bool{}
	for _, u := range urls {
		nodes[origin(u)] = true
	}
	var rt http.RoundTripper = tr
	if auth != "" {
		rt = &authTransport{next: tr, auth: auth, nodes: nodes}
	}
	conn := &Conn{HTTP: &http.Client{Transport: rt, CheckRedirect: sameNodes(nodes)}, describe: describe, warnings: warnings}
	for _, u := range urls {
		conn.urls = append(conn.urls, u.String())
	}
	conn.URL = strings.Join(conn.urls, ",")
	return conn, nil
}

// nodeSepRE is a comma that separates two nodes' URLs: one followed by a
// scheme. Any other comma (in a password) belongs to the URL.
var nodeSepRE = regexp.MustCompile(`,\s*[A-Za-z][A-Za-z0-9+.-]*://`)

// splitURLs splits ELASTICSEARCH_URL into the nodes' URLs.
func splitURLs(raw string) []string {
	var out []string
	for {
		loc := nodeSepRE.FindStringIndex(raw)
		if loc == nil {
			return append(out, raw)
		}
		out = append(out, raw[:loc[0]])
		raw = raw[loc[0]+1:]
	}
}

func readSecret(setting, file string) (string, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return "", cli.UsageError("%s=%q: %v", setting, file, err)
	}
	return strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), "\r"), nil
}

// authTransport adds the Authorization header to every request to one of
// the configured nodes, and only to them: Go's client strips sensitive
// headers on a redirect to another host only when they were set on the
// request, not when a transport adds them.
type authTransport struct {
	next  http.RoundTripper
	auth  string
	nodes map[string]bool // origin() of each configured node
}

func (t *authTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if !t.nodes[origin(r.URL)] {
		return t.next.RoundTrip(r)
	}
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", t.auth)
	return t.next.RoundTrip(r)
}

// origin is scheme://host:port of u, the port made explicit, lower case:
// what a request must match to be sent credentials.
func origin(u *url.URL) string {
	scheme := strings.ToLower(u.Scheme)
	port := u.Port()
	if port == "" {
		port = map[string]string{"http": "80", "https": "443"}[scheme]
	}
	return scheme + "://" + net.JoinHostPort(strings.ToLower(u.Hostname()), port)
}

// sameNodes refuses a redirect that leaves the configured nodes (another
// host or port, or https to http): the engine never redirects, so one is
// a proxy's misconfiguration or an attempt to collect the credentials.
func sameNodes(nodes map[string]bool) func(*http.Request, []*http.Request) error {
	return func(req *http.Request, via []*http.Request) error {
		if len(via) >= 10 {
			return errors.New("stopped after 10 redirects")
		}
		if !nodes[origin(req.URL)] {
			return fmt.Errorf("search engine redirect to %s refused: it is not one of the ELASTICSEARCH_URL nodes (credentials go to those only)", redact.URL(req.URL.String()))
		}
		return nil
	}
}

// ProbeError is a failed start-up probe, one line.
type ProbeError struct {
	URL, Auth, Hint string
	Status          int // HTTP status, 0 when no answer
	Err             error
}

func (e *ProbeError) Error() string {
	cause := ""
	if e.Err != nil {
		cause = ": " + strings.ReplaceAll(e.Err.Error(), "\n", " ")
	}
	return fmt.Sprintf("search engine %s (%s): %s%s", e.URL, e.Auth, e.Hint, cause)
}

func (e *ProbeError) Unwrap() error { return e.Err }

// Probe sends GET / once to each listed node. 401/403 and certificate
// errors are returned (one line naming the setting); a node that is down or
// slow is logged and left to the caller's retries.
func (c *Conn) Probe(ctx context.Context, logger *slog.Logger) error {
	if logger != nil {
		for _, w := range c.warnings {
			logger.Warn(w)
		}
	}
	ctx, cancel := context.WithTimeout(ctx, ProbeLimit)
	defer cancel()
	urls := c.urls
	if len(urls) == 0 { // a Conn not made by Build
		urls = []string{c.URL}
	}
	for _, u := range urls {
		if err := c.probe(ctx, logger, u); err != nil {
			return err
		}
	}
	return nil
}

func (c *Conn) probe(ctx context.Context, logger *slog.Logger, nodeURL string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, nodeURL, nil)
	if err != nil {
		return err
	}
	resp, err := c.HTTP.Do(req)
	perr := &ProbeError{URL: redact.URL(nodeURL), Auth: c.describe}
	if err == nil {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
		resp.Body.Close()
		perr.Status = resp.StatusCode
		switch {
		case resp.StatusCode == http.StatusUnauthorized:
			perr.Hint = "401 Unauthorized: check ELASTICSEARCH_USERNAME / ELASTICSEARCH_PASSWORD or ELASTICSEARCH_API_KEY"
			return perr
		case resp.StatusCode == http.StatusBadRequest:
			// GET / never is a bad request to the engine itself; a TLS proxy
			// (nginx ssl_verify_client) answers 400 to a client without a
			// certificate.
			perr.Hint = "400 Bad Request to GET /: a proxy in front of the engine may require a client certificate (ELASTICSEARCH_CERT_FILE / ELASTICSEARCH_KEY_FILE)"
			return perr
		case resp.StatusCode == http.StatusForbidden:
			perr.Hint = "403 Forbidden: the credentials are valid but lack the privileges the indexer needs (monitor, manage indices and aliases, write)"
			return perr
		case resp.StatusCode >= 500:
			if logger != nil {
				logger.Warn("search engine not ready at start; going on", slog.String("url", perr.URL), slog.Int("status", resp.StatusCode))
			}
		}
		return nil
	}
	perr.Err = err
	var (
		unknownCA x509.UnknownAuthorityError
		hostname  x509.HostnameError
		record    tls.RecordHeaderError
		op        *net.OpError
	)
	switch {
	case errors.As(err, &unknownCA):
		perr.Hint = "certificate signed by an unknown authority: set ELASTICSEARCH_CA_FILE to the CA that signed it"
	case errors.As(err, &hostname):
		perr.Hint = "certificate not valid for this host name: use the name in the certificate in ELASTICSEARCH_URL"
	case errors.As(err, &record):
		perr.Hint = "the engine did not answer TLS: use http:// in ELASTICSEARCH_URL for a plaintext endpoint"
	case errors.As(err, &op) && op.Op == "remote error": // crypto/tls's Op for an alert from the peer
		perr.Hint = "the engine refused the TLS handshake: it may require a client certificate (ELASTICSEARCH_CERT_FILE / ELASTICSEARCH_KEY_FILE)"
	default:
		if logger != nil {
			hint := "cannot reach it; the indexer retries"
			if errors.Is(err, syscall.ECONNREFUSED) {
				hint = "connection refused; the indexer retries"
			}
			logger.Warn("search engine not reachable at start: "+hint, slog.String("url", perr.URL), slog.String("error", err.Error()))
		}
		return nil
	}
	return perr
}
