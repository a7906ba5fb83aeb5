package thin

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

// jsonCorpus are documents where hand-written JSON readers usually go wrong.
var jsonCorpus = []string{
	`{}`, `[]`, `""`, `0`, `-0`, `1.5e+3`, `true`, `null`, ` {"a" : [1, 2, {"b": null}]} `,
	`{"ipam": {"socket": "/run/x.sock"}}`, `{"IPAM": {"Socket": "/a", "socket": "/b"}}`,
	`{"ipam": {"socket": "/a"}, "ipam": {"type": "x"}}`, `{"ipam": null}`, `{"ipam": {"socket": 7}}`,
	`{"ipam": {"sock\u0065t": "/e\u0301\n\t\"q\""}}`, `{"a": "\ud83d\ude00 \ud800 \udc00x \ud800\u0041"}`,
	"{\"a\": \"\xff\xfe bad utf-8\"}",
	// Invalid ones.
	``, ` `, `{`, `{"a"}`, `{"a":}`, `{"a":1,}`, `[1,]`, `01`, `1.`, `.5`, `1e`, `-`, `+1`, `tru`, `nulll`,
	`"\x"`, `"\u12G4"`, "\"a\x01\"", `{"a":1} x`, `{} {}`, `{'a':1}`, `[1 2]`, `{"a" 1}`, `"abc`,
}

func TestValidAgreesWithEncodingJSON(t *testing.T) {
	for _, doc := range jsonCorpus {
		checkAgainstEncodingJSON(t, []byte(doc))
	}
	deep := strings.Repeat("[", maxDepth) + strings.Repeat("]", maxDepth)
	checkAgainstEncodingJSON(t, []byte(deep))
	checkAgainstEncodingJSON(t, []byte("["+deep+"]"))
}

func FuzzJSON(f *testing.F) {
	for _, doc := range jsonCorpus {
		f.Add([]byte(doc))
	}
	f.Fuzz(func(t *testing.T, data []byte) { checkAgainstEncodingJSON(t, data) })
}

// checkAgainstEncodingJSON requires Valid, Lookup and Unquote to say what encoding/json
// says about data.
func checkAgainstEncodingJSON(t *testing.T, data []byte) {
	t.Helper()
	err := Valid(data)
	if want := json.Valid(data); (err == nil) != want {
		t.Fatalf("Valid(%q) = %v, encoding/json says valid=%v", data, err, want)
	}
	if err != nil {
		return
	}
	if IsString(bytes.TrimSpace(data)) {
		var want string
		if err := json.Unmarshal(data, &want); err != nil {
			t.Fatalf("encoding/json cannot read string %q: %v", data, err)
		}
		if got, err := Unquote(bytes.TrimSpace(data)); err != nil || got != want {
			t.Fatalf("Unquote(%q) = %q, %v; encoding/json reads %q", data, got, err, want)
		}
	}
	// Keys outside ASCII fold differently in encoding/json (the Kelvin sign matches "k");
	// the agent's cross-check covers those.
	if bytes.Contains(data, []byte(`\u`)) || bytes.ContainsFunc(data, func(r rune) bool { return r >= 0x80 }) {
		return
	}
	var doc struct {
		IPAM json.RawMessage `json:"ipam"`
	}
	if json.Unmarshal(data, &doc) != nil {
		return // not an object at the top
	}
	got, err := Lookup(data, "ipam")
	if err != nil || !bytes.Equal(got, doc.IPAM) {
		t.Fatalf("Lookup(%q, ipam) = %q, %v; encoding/json finds %q", data, got, err, doc.IPAM)
	}
	var ipam struct {
		Socket json.RawMessage `json:"socket"`
	}
	if json.Unmarshal(doc.IPAM, &ipam) != nil {
		return
	}
	if got, err := Lookup(data, "ipam", "socket"); err != nil || !bytes.Equal(got, ipam.Socket) {
		t.Fatalf("Lookup(%q, ipam, socket) = %q, %v; encoding/json finds %q", data, got, err, ipam.Socket)
	}
}

func TestAppendQuoteRoundTrips(t *testing.T) {
	for _, s := range []string{"", "plain", "q\"b\\s/", "\x00\x1f\x7f\n\r\t", "é😀", "\xff\xfe", "a\u2028b", "<&>"} {
		var got, want string
		if err := json.Unmarshal(AppendQuote(nil, s), &got); err != nil {
			t.Fatalf("AppendQuote(%q) = %s is not JSON: %v", s, AppendQuote(nil, s), err)
		}
		enc, _ := json.Marshal(s)
		_ = json.Unmarshal(enc, &want)
		if got != want {
			t.Errorf("AppendQuote(%q) reads back as %q; encoding/json round-trips it to %q", s, got, want)
		}
	}
}

func TestLookup(t *testing.T) {
	doc := []byte(`{"cniVersion": "1.0.0", "IPAM": {"socket": "/a", "Socket": "/b", "timeout": "5s"}, "x": [1]}`)
	for _, tt := range []struct {
		path []string
		want string
	}{
		{[]string{"ipam", "socket"}, `"/b"`},
		{[]string{"ipam", "timeout"}, `"5s"`},
		{[]string{"ipam", "missing"}, ``},
		{[]string{"x", "y"}, ``},
		{[]string{"cniVersion"}, `"1.0.0"`},
		{nil, string(doc)},
	} {
		got, err := Lookup(doc, tt.path...)
		if err != nil || string(got) != tt.want {
			t.Errorf("Lookup(%v) = %q, %v; want %q", tt.path, got, err, tt.want)
		}
	}
	if _, err := Lookup([]byte(`{"a":`), "a"); err == nil {
		t.Error("Lookup accepted a cut-off document")
	}
}
