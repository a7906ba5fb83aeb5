package allocator_test

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/leasehold/leasehold/allocator"
)

// FuzzValidateName checks the one gate every etcd key component and journal file name
// passes through. Properties:
//
//   - it agrees exactly with the documented grammar: 1 to MaxNameLen bytes,
//     [A-Za-z0-9][A-Za-z0-9._:@-]* (so never "." or "..");
//   - an accepted name has no '/', no NUL, no control or non-ASCII byte, is not "." or
//     "..", and is its own clean file name (filepath.Base and filepath.Clean leave it
//     alone), so it can neither split a key nor leave a directory;
//   - a refused name's error wraps ErrInvalidName, names the kind, and quotes the value:
//     no raw NUL, newline or other control byte of the name reaches the message (and so
//     the logs and the CNI error the runtime shows).
//
// Seeds: testdata/fuzz/FuzzValidateName.
func FuzzValidateName(f *testing.F) {
	for _, s := range []string{"net1", "eth0", "0123456789abcdef", ".", "..", "../..", "a/b", "a\x00b", "", "-x"} {
		f.Add("pool", s)
	}
	f.Fuzz(func(t *testing.T, kind, name string) {
		err := allocator.ValidateName(kind, name)
		if want := grammarAccepts(name); (err == nil) != want {
			t.Fatalf("ValidateName(%q, %q) = %v; the documented grammar says accepted=%v", kind, name, err, want)
		}
		if err != nil {
			if !errors.Is(err, allocator.ErrInvalidName) {
				t.Errorf("error %v does not wrap ErrInvalidName", err)
			}
			msg := err.Error()
			if !strings.Contains(msg, kind) {
				t.Errorf("error %q does not name the kind %q", msg, kind)
			}
			if !hasControl(kind) && hasControl(msg) {
				t.Errorf("error %q carries a raw control byte of the name", msg)
			}
			return
		}
		switch {
		case name == "" || len(name) > allocator.MaxNameLen:
			t.Errorf("accepted %d-byte name", len(name))
		case name == "." || name == "..":
			t.Errorf("accepted %q", name)
		case strings.ContainsAny(name, "/\x00\\"):
			t.Errorf("accepted %q with a separator or NUL", name)
		case !utf8.ValidString(name) || hasControl(name) || hasNonASCII(name):
			t.Errorf("accepted %q with control or non-ASCII bytes", name)
		case filepath.Base(name) != name || filepath.Clean(name) != name:
			t.Errorf("accepted %q, which is not its own clean file name", name)
		case name[0] == '-' || name[0] == '.':
			t.Errorf("accepted %q, which starts with %q", name, name[0])
		}
	})
}

// grammarAccepts is ValidateName's documented grammar, written independently.
func grammarAccepts(s string) bool {
	if len(s) == 0 || len(s) > allocator.MaxNameLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		if !alnum && (i == 0 || !strings.ContainsRune("._:@-", rune(c))) {
			return false
		}
	}
	return true
}

func hasControl(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] == 0x7f {
			return true
		}
	}
	return false
}

func hasNonASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0x80 {
			return true
		}
	}
	return false
}
