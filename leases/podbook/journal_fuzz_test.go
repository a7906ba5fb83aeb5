package podbook

import (
	"os"
	"path/filepath"
	"testing"
)

// FuzzJournalLoad feeds arbitrary bytes to the journal loader as the journal file. It must
// not panic, and what it returns must be safe to re-claim: each owner once, and every name
// that a re-claim turns into a key valid. What it skips it reports.
func FuzzJournalLoad(f *testing.F) {
	f.Add([]byte(`{"put":{"owner":"uid-1","nodeUID":"u","leaseID":"1a","attachments":[{"ifName":"eth0","pool":"p","network":"n","containerID":"c1","ips":["10.0.0.2"]}]}}` + "\n"))
	f.Add([]byte(`{"put":{"owner":"a","nodeUID":"u","leaseID":"2","attachments":[]}}` + "\n" + `{"del":"a"}` + "\n"))
	f.Add([]byte(`{"put":{"owner":"../x","nodeUID":"u","attachments":[{"ifName":"eth0","pool":"../../etc","containerID":"c"}]}}` + "\n"))
	f.Add([]byte(`{"put":{"owner":"b"},"del":"b"}` + "\n" + `{"put":{"owner":"c","nodeUID":"u"`))
	f.Add([]byte("\n\n{}\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, JournalFile), data, 0o600); err != nil {
			t.Fatal(err)
		}
		l, errs := journal{dir: dir}.load()
		seen := map[string]bool{}
		for _, ps := range l.Pods {
			if seen[ps.Owner] {
				t.Fatalf("owner %q loaded twice", ps.Owner)
			}
			seen[ps.Owner] = true
			if err := ps.validate(); err != nil {
				t.Fatalf("loaded a pod a re-claim cannot use: %v", err)
			}
			if _, ok := l.lines[ps.Owner]; !ok {
				t.Fatalf("owner %q has no journal line for the writer", ps.Owner)
			}
		}
		if l.unreadable && len(errs) == 0 {
			t.Fatal("lines skipped as unreadable without an error saying so")
		}
	})
}
