package pgconn

import (
	"crypto/tls"
	"fmt"
	"net"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// CheckTLS says whether connString verifies the server it connects to:
// pgx does only with sslmode verify-full or verify-ca (or require with
// sslrootcert, which it treats as verify-ca); its default, prefer, neither
// verifies the certificate nor insists on TLS. Every host of a multi-host
// string counts; a Unix socket does not cross the network and is fine.
//
// With require false, an unverified host other than loopback gives a
// warning (one line, no secret; "" when there is nothing to say). With
// require true (REQUIRE_TLS), any unverified TCP host, loopback included,
// is an error. A string pgx cannot parse is left to [Open] to report.
func CheckTLS(connString string, require bool) (warning string, err error) {
	cfg, perr := pgconn.ParseConfig(connString)
	if perr != nil {
		return "", nil
	}
	var all, remote []string
	seen := map[string]bool{}
	check := func(host string, port uint16, verified bool) {
		if verified || strings.HasPrefix(host, "/") { // a socket directory
			return
		}
		hp := net.JoinHostPort(host, strconv.Itoa(int(port)))
		if seen[hp] {
			return
		}
		seen[hp] = true
		all = append(all, hp)
		if !loopback(host) {
			remote = append(remote, hp)
		}
	}
	check(cfg.Host, cfg.Port, verifies(cfg.TLSConfig))
	for _, fb := range cfg.Fallbacks { // the other hosts, and prefer's plaintext retry
		check(fb.Host, fb.Port, verifies(fb.TLSConfig))
	}
	const fix = "set sslmode=verify-full and sslrootcert=<the CA's PEM file> in DATABASE_URL"
	if require && len(all) > 0 {
		return "", fmt.Errorf("REQUIRE_TLS=true: DATABASE_URL does not verify the server of %s (sslmode is not verify-full or verify-ca): %s", strings.Join(all, ", "), fix)
	}
	if len(remote) > 0 {
		return fmt.Sprintf("DATABASE_URL does not verify the server of %s (sslmode is not verify-full or verify-ca; pgx's default, prefer, even falls back to plaintext): whoever is on the path can read the traffic and the password; %s", strings.Join(remote, ", "), fix), nil
	}
	return "", nil
}

// verifies: TLS is used and the server's certificate is checked (pgx's
// verify-ca sets InsecureSkipVerify and checks the chain itself).
func verifies(c *tls.Config) bool {
	return c != nil && (!c.InsecureSkipVerify || c.VerifyPeerCertificate != nil)
}

func loopback(host string) bool {
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
