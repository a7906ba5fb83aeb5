package node

import (
	"fmt"
	"os"
	"path/filepath"
)

// WriteAside writes b as dir/name atomically: into a file aside, synced, then renamed. The
// agent keeps what must outlive a restart in its state directory this way (the settle time
// after etcd went back, the sticky claims it released): a crash leaves the old file or the
// new one, never half of one.
func WriteAside(dir, name string, b []byte) error {
	tmp := filepath.Join(dir, name+".tmp")
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("write %s: %w", tmp, err)
	}
	_, err = f.Write(b)
	if serr := f.Sync(); err == nil {
		err = serr
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write %s: %w", tmp, err)
	}
	return os.Rename(tmp, filepath.Join(dir, name))
}
