// Package redact hides secrets in connection strings before they are logged
// or shown in an error.
package redact

import (
	"net/url"
	"regexp"
)

var (
	kvPasswordRE = regexp.MustCompile(`(?i)(password\s*=\s*)('[^']*'|\S+)`)
	// userinfoRE finds scheme://user:password@ in a string that is not a
	// well-formed URL (an unescaped '#', '/' or '?' in the password, a
	// stray newline): everything from the user's ':' to the last '@' is
	// taken for the password, which over-redacts rather than leaks.
	userinfoRE = regexp.MustCompile(`([A-Za-z][A-Za-z0-9+.-]*://[^/?#@:\s]*:)[^\n]*@`)
)

// URL hides the password of a URL or of a libpq key=value connection
// string, so the result can be logged or shown in an error.
func URL(s string) string {
	if u, err := url.Parse(s); err == nil && u.Scheme != "" && u.Host != "" {
		if _, has := u.User.Password(); has {
			u.User = url.UserPassword(u.User.Username(), "xxxxx")
		}
		q := u.Query()
		if q.Has("password") {
			q.Set("password", "xxxxx")
			u.RawQuery = q.Encode()
		}
		return u.String()
	}
	return kvPasswordRE.ReplaceAllString(userinfoRE.ReplaceAllString(s, "${1}xxxxx@"), "${1}xxxxx")
}
