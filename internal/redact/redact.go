// Package redact hides secrets before they are logged or shown in an error,
// in two ways that back each other up:
//
//   - [URL] masks the password of a connection string by its shape, in
//     every form pgx and the search client accept (URL, key=value, several
//     hosts or URLs), without trusting url.Parse: a password with an
//     unescaped '#', '?', '/', '@', ':' or ',' is still found.
//   - A process-wide registry of known secret values ([Add], filled when the
//     settings and their *_FILE files are read) masks those values wherever
//     they occur: [String] on any text, [NewHandler] on every log record,
//     and the error line the binaries print on exit.
package redact

import (
	"encoding/json"
	"net/url"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
)

// Mask replaces every hidden value.
const Mask = "xxxxx"

// MinLen is the shortest value [Add] registers: masking a shorter one
// everywhere would garble every log line that happens to contain it. (The
// shape-based masking of [URL] hides passwords of any length.)
const MinLen = 4

var (
	// schemeRE finds the start of a URL.
	schemeRE = regexp.MustCompile(`[A-Za-z][A-Za-z0-9+.-]*://`)
	// kvPasswordRE finds a password in a libpq key=value string: the key
	// (anything ending in password or passphrase) at the start or after
	// white space, '=' with optional white space around it, and the value as
	// libpq and pgx read it: single-quoted with backslash escapes (an
	// unterminated quote runs to the end), or up to white space, a
	// backslash escaping the next character.
	kvPasswordRE = regexp.MustCompile(`(?is)(^|\s)(\w*(?:password|passphrase)\s*=\s*)('(?:[^'\\]|\\.)*(?:'|\\?$)|(?:[^\s\\]|\\.|\\$)+)`)
)

// URL hides the passwords of a connection string: a URL (several hosts or
// several comma-separated URLs included) or a libpq key=value string, so
// the result can be logged or shown in an error. A password in the user
// info is taken to run from the user's ':' to the last '@' of the string
// (with several URLs, from the first user's ':' to the last URL's '@': a
// password may hold a comma or "://" too), and a password query parameter
// to the next '&' ('#' included); this over-redacts rather than leaks.
func URL(s string) string {
	if !schemeRE.MatchString(s) {
		return keyValue(s)
	}
	if loc := schemeRE.FindStringIndex(strings.TrimSpace(s)); loc != nil && loc[0] == 0 {
		// A URL: a "password=" in it is in the user info or a query.
		return urlSegment(s)
	}
	// Text, or a key=value string (whose quoted password may hold
	// "://"): its passwords first, then what looks like a URL.
	s = keyValue(s)
	if starts := urlStarts(s); len(starts) > 0 {
		return s[:starts[0]] + urlSegment(s[starts[0]:])
	}
	return s
}

// urlStarts lists where URLs begin in s: a scheme followed by "://" at the
// start of s or after a separator (a comma, white space, a quote, '=').
func urlStarts(s string) []int {
	var starts []int
	for _, m := range schemeRE.FindAllStringIndex(s, -1) {
		if m[0] == 0 || strings.ContainsRune(", \t\r\n\"'=(<[", rune(s[m[0]-1])) {
			starts = append(starts, m[0])
		}
	}
	return starts
}

// urlSegment masks one URL (and whatever follows it up to the next one).
func urlSegment(seg string) string {
	i := strings.Index(seg, "://") + len("://")
	head, rest := seg[:i], seg[i:]
	if at := strings.LastIndexByte(rest, '@'); at >= 0 {
		if c := strings.IndexByte(rest[:at], ':'); c >= 0 {
			head += rest[:c+1] + Mask
			rest = rest[at:]
		}
	}
	q := strings.IndexByte(rest, '?')
	if q < 0 {
		return head + rest
	}
	params := strings.Split(rest[q+1:], "&")
	for j, p := range params {
		key, _, ok := strings.Cut(p, "=")
		if ok && secretKey(key) {
			params[j] = key + "=" + Mask
		}
	}
	return head + rest[:q+1] + strings.Join(params, "&")
}

// secretKey reports whether a query parameter holds a secret.
func secretKey(key string) bool {
	if k, err := url.QueryUnescape(key); err == nil {
		key = k
	}
	key = strings.ToLower(strings.TrimSpace(key))
	return strings.HasSuffix(key, "password") || strings.HasSuffix(key, "passphrase")
}

func keyValue(s string) string {
	return kvPasswordRE.ReplaceAllString(s, "${1}${2}"+Mask)
}

// The registry of known secret values.
var reg struct {
	mu     sync.RWMutex
	values map[string]bool
	rep    *strings.Replacer // nil when empty
}

// Add registers secret values (passwords, API keys, passphrases) so that
// [String], [NewHandler] and the binaries' error line mask them wherever
// they occur, also in the escaped forms a URL, a quoted string, JSON or a
// key=value string would show. Values shorter than [MinLen] are ignored.
func Add(values ...string) {
	reg.mu.Lock()
	defer reg.mu.Unlock()
	if reg.values == nil {
		reg.values = map[string]bool{}
	}
	changed := false
	for _, v := range values {
		for _, f := range forms(v) {
			if len(f) >= MinLen && !reg.values[f] {
				reg.values[f] = true
				changed = true
			}
		}
	}
	if !changed {
		return
	}
	all := make([]string, 0, len(reg.values))
	for v := range reg.values {
		all = append(all, v)
	}
	// strings.Replacer tries the old strings in argument order at each
	// position: longest first, so a secret that contains another is masked
	// whole.
	sort.Slice(all, func(i, j int) bool {
		if len(all[i]) != len(all[j]) {
			return len(all[i]) > len(all[j])
		}
		return all[i] < all[j]
	})
	pairs := make([]string, 0, 2*len(all))
	for _, v := range all {
		pairs = append(pairs, v, Mask)
	}
	reg.rep = strings.NewReplacer(pairs...)
}

// forms are v and the ways it is written escaped.
func forms(v string) []string {
	if len(v) < MinLen {
		return nil
	}
	fs := []string{v, url.QueryEscape(v), url.PathEscape(v), strings.TrimPrefix(url.UserPassword("", v).String(), ":")}
	q := strconv.Quote(v)
	fs = append(fs, q[1:len(q)-1])
	q = strconv.QuoteToASCII(v)
	fs = append(fs, q[1:len(q)-1])
	if j, err := json.Marshal(v); err == nil {
		fs = append(fs, string(j[1:len(j)-1]))
	}
	fs = append(fs, strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(v))
	return fs
}

// AddConnString registers the passwords of a connection string (see [URL]
// for the forms), as written and unescaped, so that an error or a log line
// that quotes the password alone is masked too.
func AddConnString(s string) {
	var secrets []string
	starts := urlStarts(s)
	if len(starts) > 0 {
		// As URL reads it (one segment), and node by node (a list of
		// search engine URLs, each with its user info).
		secrets = append(secrets, urlSecrets(s[starts[0]:])...)
		for i, st := range starts {
			end := len(s)
			if i+1 < len(starts) {
				end = starts[i+1]
			}
			secrets = append(secrets, urlSecrets(s[st:end])...)
		}
		if u, err := url.Parse(strings.TrimSpace(s)); err == nil {
			if p, ok := u.User.Password(); ok {
				secrets = append(secrets, p)
			}
		}
	}
	for _, m := range kvPasswordRE.FindAllStringSubmatch(s, -1) {
		v := m[3]
		secrets = append(secrets, v)
		if strings.HasPrefix(v, "'") {
			v = strings.TrimSuffix(strings.TrimPrefix(v, "'"), "'")
			secrets = append(secrets, v)
		}
		secrets = append(secrets, unescapeKV(v))
	}
	Add(secrets...)
}

func urlSecrets(seg string) []string {
	var out []string
	rest := seg[strings.Index(seg, "://")+len("://"):]
	if at := strings.LastIndexByte(rest, '@'); at >= 0 {
		if c := strings.IndexByte(rest[:at], ':'); c >= 0 {
			p := rest[c+1 : at]
			out = append(out, p)
			if u, err := url.PathUnescape(p); err == nil {
				out = append(out, u)
			}
			rest = rest[at:]
		}
	}
	if q := strings.IndexByte(rest, '?'); q >= 0 {
		for _, p := range strings.Split(rest[q+1:], "&") {
			key, v, ok := strings.Cut(p, "=")
			if ok && secretKey(key) {
				out = append(out, v)
				if u, err := url.QueryUnescape(v); err == nil {
					out = append(out, u)
				}
			}
		}
	}
	return out
}

func unescapeKV(v string) string {
	var b strings.Builder
	for i := 0; i < len(v); i++ {
		if v[i] == '\\' && i+1 < len(v) {
			i++
		}
		b.WriteByte(v[i])
	}
	return b.String()
}

// String masks every registered secret value in s.
func String(s string) string {
	reg.mu.RLock()
	rep := reg.rep
	reg.mu.RUnlock()
	if rep == nil {
		return s
	}
	return rep.Replace(s)
}

// Reset empties the registry (tests).
func Reset() {
	reg.mu.Lock()
	defer reg.mu.Unlock()
	reg.values, reg.rep = nil, nil
}
