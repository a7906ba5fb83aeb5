package adopt

import (
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"github.com/leasehold/leasehold/allocator"
)

// HostLocalDir is where host-local keeps a network's allocations when its ipam
// configuration sets no dataDir: one directory per network name.
const HostLocalDir = "/var/lib/cni/networks"

// maxHostLocalFile bounds what is read of one address file: a container ID, a line break
// and an interface name.
const maxHostLocalFile = 4096

// HostLocal reads host-local's data directory for one network (HostLocalDir/<network>, or
// <dataDir>/<network>). host-local names one file per allocated address after the address
// (IPv6 too; on Windows with ":" written "_"), holding the container ID, "\r\n" and the
// interface name; older versions wrote the container ID alone. Its lock file
// ("lock") and its "last_reserved_ip.<range set>" files are not allocations and are
// skipped, as is anything else whose name is not an address, directories included
// (returned in skipped).
//
// An address file whose content is not a container ID (and an interface name) that could
// be an etcd key part is an error naming the file: it may hold a running container's
// address, and leasehold must not hand that out for want of reading it. So is a directory
// named after network: dir is then host-local's dataDir, which holds one directory per
// network, and importing nothing from it would leave the running containers' addresses to
// be handed out again.
func HostLocal(dir, network string) (recs []Record, skipped []string, err error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, nil, fmt.Errorf("read host-local's data directory: %w (host-local keeps one directory per network, "+
			"%s/<network name> unless its ipam configuration sets dataDir)", err, HostLocalDir)
	}
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() && name == network {
			return nil, nil, fmt.Errorf("%s holds a directory named after network %s, as host-local's dataDir does (one "+
				"directory per network): give the network's own directory, %s", dir, network, filepath.Join(dir, name))
		}
		if name == "lock" || strings.HasPrefix(name, "last_reserved_ip.") {
			continue
		}
		addr, err := netip.ParseAddr(strings.ReplaceAll(name, "_", ":"))
		if err != nil || addr.Zone() != "" || e.IsDir() {
			skipped = append(skipped, filepath.Join(dir, name))
			continue
		}
		path := filepath.Join(dir, name)
		rec, err := readHostLocalFile(path)
		if err != nil {
			return nil, nil, err
		}
		rec.Addr = addr.Unmap()
		recs = append(recs, rec)
	}
	return recs, skipped, nil
}

// readHostLocalFile reads one address file: "<container ID>\r\n<interface>", or the
// container ID alone.
func readHostLocalFile(path string) (Record, error) {
	f, err := os.Open(path)
	if err != nil {
		return Record{}, fmt.Errorf("read host-local's allocation %s: %w", path, err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxHostLocalFile+1))
	if err != nil {
		return Record{}, fmt.Errorf("read host-local's allocation %s: %w", path, err)
	}
	if len(b) > maxHostLocalFile {
		return Record{}, fmt.Errorf("host-local's allocation %s is over %d bytes; it should hold a container ID and an interface name",
			path, maxHostLocalFile)
	}
	container, ifName, _ := strings.Cut(strings.ReplaceAll(string(b), "\r\n", "\n"), "\n")
	container, ifName = strings.TrimSpace(container), strings.TrimSpace(ifName)
	if err := allocator.ValidateName("container ID", container); err != nil {
		return Record{}, fmt.Errorf("host-local's allocation %s: %w", path, err)
	}
	if ifName != "" {
		if err := allocator.ValidateName("interface", ifName); err != nil {
			return Record{}, fmt.Errorf("host-local's allocation %s: %w", path, err)
		}
	}
	return Record{ContainerID: container, IfName: ifName, Where: path}, nil
}
