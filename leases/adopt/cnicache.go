package adopt

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/containernetworking/cni/libcni"
)

// CNICacheDir is where the CNI library keeps the result of each ADD until the DEL, unless the
// runtime configures another directory: containerd, CRI-O and podman call plugins through
// that library, so its cache lists the attachments a node's runtime believes it has.
var CNICacheDir = libcni.CacheDir

// Cached lists the attachments of network that the CNI library's result cache in dir
// (dir/results) records: ADDs a runtime made and has not deleted. The import of host-local's
// directory compares it with the address files it found, so that a directory given by
// mistake (not the one host-local writes this network's addresses to) stops the agent
// instead of importing nothing. found is false when dir has no cache at all: nothing can be
// told from it then.
func Cached(dir, network string) (atts []Attachment, found bool, err error) {
	if _, err := os.Stat(filepath.Join(dir, "results")); errors.Is(err, fs.ErrNotExist) {
		return nil, false, nil
	} else if err != nil {
		return nil, false, fmt.Errorf("the CNI result cache: %w", err)
	}
	all, err := libcni.NewCNIConfigWithCacheDir(nil, dir, nil).GetCachedAttachments("")
	if err != nil {
		return nil, true, fmt.Errorf("read the CNI result cache %s: %w", filepath.Join(dir, "results"), err)
	}
	for _, a := range all {
		if a.Network == network {
			atts = append(atts, Attachment{ContainerID: a.ContainerID, IfName: a.IfName,
				Where: []string{filepath.Join(dir, "results", a.Network+"-"+a.ContainerID+"-"+a.IfName)}})
		}
	}
	return atts, true, nil
}
