// Package jsonvalid checks JSON the way encoding/json's Valid does, several
// times faster: the indexer checks every message's document with it, the
// batcher every document a custom Go processor returns.
package jsonvalid

import (
	"bytes"
	"encoding/binary"
)

// Valid reports whether data is valid JSON exactly as json.Valid does:
// the same grammar, the same nesting limit, and no UTF-8 check inside
// strings. It is several times faster than json.Valid, which spends a call
// per byte: the bulk of a document is string contents, which Valid skips
// eight bytes at a time.
// FuzzValidJSON holds it to json.Valid.
func Valid(data []byte) bool {
	v := jsonValidator{data: data}
	v.skipSpace()
	if !v.value(0) {
		return false
	}
	v.skipSpace()
	return v.i == len(v.data)
}

// Document is Valid that also returns the top-level member names
// of data that start with an underscore (or contain an escape, which may
// spell one), raw as they appear in data, without the quotes. They are
// rare, so this costs one byte comparison per top-level member.
func Document(data []byte) (ok bool, underscored [][]byte) {
	v := jsonValidator{data: data, collect: true}
	v.skipSpace()
	if !v.value(0) {
		return false, nil
	}
	v.skipSpace()
	return v.i == len(v.data), v.underscored
}

// maxJSONDepth is encoding/json's limit on nested objects and arrays.
const maxJSONDepth = 10000

type jsonValidator struct {
	data []byte
	i    int
	// collect: gather the top-level member names that start with '_' or
	// hold a backslash into underscored.
	collect     bool
	underscored [][]byte
}

// peek returns the next byte, or 0 (never valid where a byte is
// expected) at the end.
func (v *jsonValidator) peek() byte {
	if v.i < len(v.data) {
		return v.data[v.i]
	}
	return 0
}

func (v *jsonValidator) skipSpace() {
	for v.i < len(v.data) {
		switch v.data[v.i] {
		case ' ', '\t', '\n', '\r':
			v.i++
		default:
			return
		}
	}
}

// value checks one value; depth is the number of enclosing containers.
func (v *jsonValidator) value(depth int) bool {
	switch c := v.peek(); {
	case c == '{':
		return v.object(depth + 1)
	case c == '[':
		return v.array(depth + 1)
	case c == '"':
		return v.string()
	case c == '-' || isDigit(c):
		return v.number()
	case c == 't':
		return v.literal("true")
	case c == 'f':
		return v.literal("false")
	case c == 'n':
		return v.literal("null")
	}
	return false
}

func (v *jsonValidator) object(depth int) bool {
	if depth > maxJSONDepth {
		return false
	}
	v.i++ // {
	v.skipSpace()
	if v.peek() == '}' {
		v.i++
		return true
	}
	for {
		start := v.i
		if v.peek() != '"' || !v.string() {
			return false
		}
		if v.collect && depth == 1 {
			if name := v.data[start+1 : v.i-1]; len(name) > 0 && (name[0] == '_' || bytes.IndexByte(name, '\\') >= 0) {
				v.underscored = append(v.underscored, name)
			}
		}
		v.skipSpace()
		if v.peek() != ':' {
			return false
		}
		v.i++
		v.skipSpace()
		if !v.value(depth) {
			return false
		}
		if more, ok := v.next('}'); !more {
			return ok
		}
	}
}

func (v *jsonValidator) array(depth int) bool {
	if depth > maxJSONDepth {
		return false
	}
	v.i++ // [
	v.skipSpace()
	if v.peek() == ']' {
		v.i++
		return true
	}
	for {
		if !v.value(depth) {
			return false
		}
		if more, ok := v.next(']'); !more {
			return ok
		}
	}
}

// next reads what follows a member or an element: a comma (more follows)
// or the closing byte (done, valid); anything else is invalid.
func (v *jsonValidator) next(closing byte) (more, ok bool) {
	v.skipSpace()
	switch v.peek() {
	case ',':
		v.i++
		v.skipSpace()
		return true, true
	case closing:
		v.i++
		return false, true
	default:
		return false, false
	}
}

const (
	ones  = 0x0101010101010101
	highs = 0x8080808080808080
)

// plainWord reports whether none of the eight bytes of w is a quote, a
// backslash or a control character (the usual has-zero-byte and
// has-byte-less-than tricks; each test is exact for "any byte").
func plainWord(w uint64) bool {
	quote := w ^ (ones * '"')
	backslash := w ^ (ones * '\\')
	special := (quote - ones) & ^quote
	special |= (backslash - ones) & ^backslash
	special |= (w - ones*0x20) & ^w
	return special&highs == 0
}

func (v *jsonValidator) string() bool {
	v.i++ // opening quote
	for {
		for v.i+8 <= len(v.data) && plainWord(binary.LittleEndian.Uint64(v.data[v.i:])) {
			v.i += 8
		}
		if v.i >= len(v.data) {
			return false
		}
		switch c := v.data[v.i]; {
		case c == '"':
			v.i++
			return true
		case c == '\\':
			v.i++
			switch v.peek() {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				v.i++
			case 'u':
				if v.i+5 > len(v.data) {
					return false
				}
				for _, h := range v.data[v.i+1 : v.i+5] {
					if !isDigit(h) && (h|0x20 < 'a' || h|0x20 > 'f') {
						return false
					}
				}
				v.i += 5
			default:
				return false
			}
		case c < 0x20:
			return false
		default:
			v.i++
		}
	}
}

func (v *jsonValidator) number() bool {
	if v.peek() == '-' {
		v.i++
	}
	switch c := v.peek(); {
	case c == '0':
		v.i++
	case '1' <= c && c <= '9':
		v.digits()
	default:
		return false
	}
	if v.peek() == '.' {
		v.i++
		if !isDigit(v.peek()) {
			return false
		}
		v.digits()
	}
	if c := v.peek(); c == 'e' || c == 'E' {
		v.i++
		if c := v.peek(); c == '+' || c == '-' {
			v.i++
		}
		if !isDigit(v.peek()) {
			return false
		}
		v.digits()
	}
	return true
}

func (v *jsonValidator) digits() {
	for isDigit(v.peek()) {
		v.i++
	}
}

func (v *jsonValidator) literal(lit string) bool {
	if len(v.data)-v.i < len(lit) || string(v.data[v.i:v.i+len(lit)]) != lit {
		return false
	}
	v.i += len(lit)
	return true
}

func isDigit(c byte) bool { return '0' <= c && c <= '9' }
