package thin

import (
	"errors"
	"strconv"
	"unicode/utf16"
	"unicode/utf8"
)

// The little JSON the plugin process needs, without encoding/json: check that a document
// is valid, find a value by its path of object keys, read strings and integers, and write
// strings. Key lookup follows encoding/json's decoding into a struct: keys match without
// regard to ASCII case, and of repeated keys the last wins. The agent parses the same
// document with encoding/json and refuses the request if it finds another socket than the
// one the plugin dialed, so a disagreement is an error, never a misdirected request.

// maxDepth bounds nesting, as encoding/json does.
const maxDepth = 10000

// errSyntax is wrapped by every error Valid and Lookup return for a malformed document.
var errSyntax = errors.New("invalid JSON")

type syntaxError struct {
	msg string
	off int
}

func (e *syntaxError) Error() string {
	return e.msg + " at offset " + strconv.Itoa(e.off)
}

func (e *syntaxError) Unwrap() error { return errSyntax }

func syntaxErr(msg string, off int) error { return &syntaxError{msg, off} }

// scanner walks one document.
type scanner struct {
	data []byte
}

func (s *scanner) ws(i int) int {
	for i < len(s.data) {
		switch s.data[i] {
		case ' ', '\t', '\n', '\r':
			i++
		default:
			return i
		}
	}
	return i
}

// value checks the value starting at i (after whitespace) and returns the offset just
// past it.
func (s *scanner) value(i, depth int) (int, error) {
	i = s.ws(i)
	if i >= len(s.data) {
		return i, syntaxErr("unexpected end of JSON input", i)
	}
	switch c := s.data[i]; {
	case c == '{':
		return s.object(i, depth+1, nil)
	case c == '[':
		if depth+1 > maxDepth {
			return i, syntaxErr("exceeded max depth", i)
		}
		i = s.ws(i + 1)
		if i < len(s.data) && s.data[i] == ']' {
			return i + 1, nil
		}
		for {
			end, err := s.value(i, depth+1)
			if err != nil {
				return end, err
			}
			var done bool
			if i, done, err = s.next(end, ']', "array element"); done || err != nil {
				return i, err
			}
		}
	case c == '"':
		return s.str(i)
	case c == '-' || c >= '0' && c <= '9':
		return s.number(i)
	case c == 't':
		return s.literal(i, "true")
	case c == 'f':
		return s.literal(i, "false")
	case c == 'n':
		return s.literal(i, "null")
	}
	return i, syntaxErr("invalid character looking for beginning of value", i)
}

// object checks the object starting at i; for each member it calls visit (when not
// nil) with the raw key (quotes included) and the value's extent.
func (s *scanner) object(i, depth int, visit func(key []byte, start, end int)) (int, error) {
	if depth > maxDepth {
		return i, syntaxErr("exceeded max depth", i)
	}
	i = s.ws(i + 1)
	if i < len(s.data) && s.data[i] == '}' {
		return i + 1, nil
	}
	for {
		i = s.ws(i)
		if i >= len(s.data) || s.data[i] != '"' {
			return i, syntaxErr("invalid character looking for beginning of object key string", i)
		}
		kend, err := s.str(i)
		if err != nil {
			return kend, err
		}
		key := s.data[i:kend]
		i = s.ws(kend)
		if i >= len(s.data) || s.data[i] != ':' {
			return i, syntaxErr("invalid character after object key", i)
		}
		start := s.ws(i + 1)
		end, err := s.value(start, depth)
		if err != nil {
			return end, err
		}
		if visit != nil {
			visit(key, start, end)
		}
		var done bool
		if i, done, err = s.next(end, '}', "object key:value pair"); done || err != nil {
			return i, err
		}
	}
}

// next steps over what follows an element of an array or object ending at end: a comma
// (it returns the offset after it) or the closing bracket (done, the offset past it).
func (s *scanner) next(end int, closer byte, element string) (int, bool, error) {
	i := s.ws(end)
	switch {
	case i >= len(s.data):
		return i, false, syntaxErr("unexpected end of JSON input", i)
	case s.data[i] == ',':
		return i + 1, false, nil
	case s.data[i] == closer:
		return i + 1, true, nil
	}
	return i, false, syntaxErr("invalid character after "+element, i)
}

func (s *scanner) str(i int) (int, error) {
	i++ // the opening quote
	for i < len(s.data) {
		c := s.data[i]
		switch {
		case c == '"':
			return i + 1, nil
		case c < 0x20:
			return i, syntaxErr("invalid control character in string literal", i)
		case c == '\\':
			if i+1 >= len(s.data) {
				return i, syntaxErr("unexpected end of JSON input", i)
			}
			switch s.data[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if i+6 > len(s.data) {
					return i, syntaxErr("unexpected end of JSON input", i)
				}
				for _, h := range s.data[i+2 : i+6] {
					if !isHex(h) {
						return i, syntaxErr("invalid character in \\u hexadecimal character escape", i)
					}
				}
				i += 6
			default:
				return i, syntaxErr("invalid character in string escape code", i)
			}
		default:
			i++
		}
	}
	return i, syntaxErr("unexpected end of JSON input", i)
}

func isHex(c byte) bool { return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F' }

func (s *scanner) number(i int) (int, error) {
	digits := func(i int) (int, bool) {
		j := i
		for j < len(s.data) && s.data[j] >= '0' && s.data[j] <= '9' {
			j++
		}
		return j, j > i
	}
	if s.data[i] == '-' {
		i++
	}
	if i < len(s.data) && s.data[i] == '0' {
		i++
	} else {
		var ok bool
		if i, ok = digits(i); !ok {
			return i, syntaxErr("invalid character in numeric literal", i)
		}
	}
	if i < len(s.data) && s.data[i] == '.' {
		var ok bool
		if i, ok = digits(i + 1); !ok {
			return i, syntaxErr("invalid character after decimal point in numeric literal", i)
		}
	}
	if i < len(s.data) && (s.data[i] == 'e' || s.data[i] == 'E') {
		i++
		if i < len(s.data) && (s.data[i] == '+' || s.data[i] == '-') {
			i++
		}
		var ok bool
		if i, ok = digits(i); !ok {
			return i, syntaxErr("invalid character in exponent of numeric literal", i)
		}
	}
	return i, nil
}

func (s *scanner) literal(i int, lit string) (int, error) {
	for k := 0; k < len(lit); k++ {
		if i+k >= len(s.data) {
			return i + k, syntaxErr("unexpected end of JSON input", i+k)
		}
		if s.data[i+k] != lit[k] {
			return i + k, syntaxErr("invalid character in literal "+lit, i+k)
		}
	}
	return i + len(lit), nil
}

// Valid reports whether data is one JSON value, with nothing but whitespace around it;
// the error says what is wrong and where.
func Valid(data []byte) error {
	s := scanner{data}
	end, err := s.value(0, 0)
	if err != nil {
		return err
	}
	if end = s.ws(end); end != len(data) {
		return syntaxErr("invalid character after top-level value", end)
	}
	return nil
}

// Lookup returns the raw value at path (object keys, outermost first) in the valid JSON
// document data, or nil when some step is missing or not an object. Keys compare as
// encoding/json compares them with struct field names: ASCII case does not matter, and
// the last of repeated keys counts. An invalid document is an error.
func Lookup(data []byte, path ...string) ([]byte, error) {
	if err := Valid(data); err != nil {
		return nil, err
	}
	s := scanner{data}
	cur := data[s.ws(0):]
	for _, want := range path {
		if len(cur) == 0 || cur[0] != '{' {
			return nil, nil
		}
		var found []byte
		sub := scanner{cur}
		// cur is a valid object: the walk cannot fail.
		_, _ = sub.object(0, 1, func(key []byte, start, end int) {
			if k, err := Unquote(key); err == nil && asciiFoldEqual(k, want) {
				found = cur[start:end]
			}
		})
		if found == nil {
			return nil, nil
		}
		cur = found
	}
	return cur, nil
}

func asciiFoldEqual(a, b string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := 0; i < len(a); i++ {
		x, y := a[i], b[i]
		if 'A' <= x && x <= 'Z' {
			x += 'a' - 'A'
		}
		if 'A' <= y && y <= 'Z' {
			y += 'a' - 'A'
		}
		if x != y {
			return false
		}
	}
	return true
}

// IsString reports whether raw (a value from Lookup) is a JSON string.
func IsString(raw []byte) bool { return len(raw) > 0 && raw[0] == '"' }

// Unquote decodes the JSON string raw (quotes included) as encoding/json does: invalid
// UTF-8 and unpaired surrogates become U+FFFD.
func Unquote(raw []byte) (string, error) {
	if len(raw) < 2 || raw[0] != '"' || raw[len(raw)-1] != '"' {
		return "", syntaxErr("not a JSON string", 0)
	}
	in := raw[1 : len(raw)-1]
	out := make([]byte, 0, len(in))
	for i := 0; i < len(in); {
		c := in[i]
		switch {
		case c == '\\':
			if i+1 >= len(in) {
				return "", syntaxErr("unexpected end of string", i)
			}
			switch e := in[i+1]; e {
			case '"', '\\', '/':
				out = append(out, e)
			case 'b':
				out = append(out, '\b')
			case 'f':
				out = append(out, '\f')
			case 'n':
				out = append(out, '\n')
			case 'r':
				out = append(out, '\r')
			case 't':
				out = append(out, '\t')
			case 'u':
				r, ok := hex4(in, i+2)
				if !ok {
					return "", syntaxErr("invalid \\u escape", i)
				}
				i += 6
				if utf16.IsSurrogate(r) {
					if r2, ok := hex4(in, i+2); ok && i+1 < len(in) && in[i] == '\\' && in[i+1] == 'u' {
						if dec := utf16.DecodeRune(r, r2); dec != utf8.RuneError {
							out = utf8.AppendRune(out, dec)
							i += 6
							continue
						}
					}
					r = utf8.RuneError
				}
				out = utf8.AppendRune(out, r)
				continue
			default:
				return "", syntaxErr("invalid escape", i)
			}
			i += 2
		case c < utf8.RuneSelf:
			out = append(out, c)
			i++
		default:
			r, size := utf8.DecodeRune(in[i:])
			out = utf8.AppendRune(out, r) // RuneError for invalid bytes, as encoding/json
			i += size
		}
	}
	return string(out), nil
}

func hex4(b []byte, i int) (rune, bool) {
	if i+4 > len(b) {
		return 0, false
	}
	v, err := strconv.ParseUint(string(b[i:i+4]), 16, 32)
	return rune(v), err == nil
}

// Int reads raw (a value from Lookup) as an integer.
func Int(raw []byte) (int, bool) {
	n, err := strconv.Atoi(string(raw))
	return n, err == nil
}

// AppendQuote appends s as a JSON string, escaping what JSON requires and writing
// invalid UTF-8 as U+FFFD, as encoding/json does.
func AppendQuote(dst []byte, s string) []byte {
	const hex = "0123456789abcdef"
	dst = append(dst, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\':
				dst = append(dst, '\\', c)
			case c == '\n':
				dst = append(dst, '\\', 'n')
			case c == '\r':
				dst = append(dst, '\\', 'r')
			case c == '\t':
				dst = append(dst, '\\', 't')
			case c < 0x20:
				dst = append(dst, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			default:
				dst = append(dst, c)
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			dst = append(dst, `\ufffd`...)
		} else {
			dst = append(dst, s[i:i+size]...)
		}
		i += size
	}
	return append(dst, '"')
}
