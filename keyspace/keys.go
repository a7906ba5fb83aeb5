package keyspace

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/leasehold/leasehold/allocator"
)

// Prefix is the root of every key leasehold writes. The v1 layout below it is stable:
// admins' scripts read it with plain etcdctl.
const Prefix = "/leasehold/v1/"

// Key families under Prefix. ARCHITECTURE.md documents each, and docs/operations.md the
// etcdctl commands an admin types to read them.
const (
	poolsDir      = Prefix + "pools/"
	ipsDir        = Prefix + "ips/"
	ownersDir     = Prefix + "owners/"
	nodesDir      = Prefix + "nodes/"
	quarantineDir = Prefix + "quarantine/"
	conflictsDir  = Prefix + "conflicts/"
	hostIPsDir    = Prefix + "hostips/"
	poolConflicts = Prefix + "poolconflicts/"
	blocksDir     = Prefix + "blocks/"
	heldDir       = Prefix + "held/"
	wantedDir     = Prefix + "wanted/"
)

// PoolConflictKey is /leasehold/v1/poolconflicts/<pool>/<cluster>/<node>: a node of cluster
// wanted pool defined differently from the stored definition; on that node's lease.
func PoolConflictKey(pool, cluster, node string) string {
	return PoolConflictsPrefix(pool) + cluster + "/" + node
}

// PoolConflictsPrefix is the prefix of pool's definition conflicts; with pool "" of all.
func PoolConflictsPrefix(pool string) string {
	if pool == "" {
		return poolConflicts
	}
	return poolConflicts + pool + "/"
}

// HostIPKey is /leasehold/v1/hostips/<ip>/<cluster>/<node>: an address the node itself uses,
// published by its agent on the node lease; no pool hands it out.
func HostIPKey(ip netip.Addr, cluster, node string) string {
	return HostIPPrefix(ip) + cluster + "/" + node
}

// HostIPPrefix is the prefix of every node's key for ip; with an invalid ip, of all host addresses.
func HostIPPrefix(ip netip.Addr) string {
	if !ip.IsValid() {
		return hostIPsDir
	}
	return hostIPsDir + ip.String() + "/"
}

// ParseHostIPKey returns the address of a host address key.
func ParseHostIPKey(key string) (netip.Addr, error) {
	rest, ok := strings.CutPrefix(key, hostIPsDir)
	if !ok {
		return netip.Addr{}, fmt.Errorf("key %q is not under %s", key, hostIPsDir)
	}
	addr, _, _ := strings.Cut(rest, "/")
	return netip.ParseAddr(addr)
}

// PoolKey is /leasehold/v1/pools/<pool>: the pool's definition (no lease).
func PoolKey(pool string) string { return poolsDir + pool }

// PoolsPrefix is the prefix of every pool definition.
func PoolsPrefix() string { return poolsDir }

// IPKey is the allocation key of ip in a pool divided by b, on its owner's pod lease:
// /leasehold/v1/ips/<pool>/<block>/<ip>, or /leasehold/v1/ips/<pool>/<ip> in the flat
// layout (b zero). Every writer derives the block from the stored definition, so one address
// has one key.
func IPKey(pool string, b allocator.Blocks, ip netip.Addr) string {
	return ipsDir + pool + "/" + addrPart(b, ip)
}

// IPsPrefix is the prefix of every allocation of pool; with pool "" of every pool.
func IPsPrefix(pool string) string {
	if pool == "" {
		return ipsDir
	}
	return ipsDir + pool + "/"
}

// QuarantineKey is the key of ip resting before reuse after a release, on a short quarantine
// lease: /leasehold/v1/quarantine/<pool>/<block>/<ip> (flat: .../<pool>/<ip>).
func QuarantineKey(pool string, b allocator.Blocks, ip netip.Addr) string {
	return quarantineDir + pool + "/" + addrPart(b, ip)
}

// QuarantinePrefix is the prefix of pool's quarantined addresses; with pool "" of every pool.
func QuarantinePrefix(pool string) string {
	if pool == "" {
		return quarantineDir
	}
	return quarantineDir + pool + "/"
}

// HeldKey is /leasehold/v1/held/<pool>/<block>/<ip> (flat: .../<pool>/<ip>): the node whose pod
// holds ip, written with the allocation and deleted with its release, on that node's block
// lease. The block lease outlives the pod leases by the reuse delay, so a held key without an
// allocation marks an address whose holder expired without a release (its node dead or cut
// off): held back from reuse while the pool has other room, and its node's to re-claim.
func HeldKey(pool string, b allocator.Blocks, ip netip.Addr) string {
	return heldDir + pool + "/" + addrPart(b, ip)
}

// HeldPrefix is the prefix of pool's held keys; with pool "" of every pool's.
func HeldPrefix(pool string) string {
	if pool == "" {
		return heldDir
	}
	return heldDir + pool + "/"
}

// IPKeyOfHeld is the allocation key of the address a held key stands for.
func IPKeyOfHeld(heldKey string) string { return ipsDir + strings.TrimPrefix(heldKey, heldDir) }

// ParseHeldKey splits a held key into its pool, block and address.
func ParseHeldKey(key string) (pool string, block netip.Prefix, ip netip.Addr, err error) {
	return parsePoolAddr(heldDir, key)
}

// WantedKey is /leasehold/v1/wanted/<pool>/<block>/<ip>/<cluster>/<owner> (flat: without
// <block>): a running pod of cluster wants ip back, which another owner took while its lease
// was lost (a conflict). Written with the conflict record, on its node's block lease (like a
// held key, it outlives the pod lease by the reuse delay); deleted when the pod gets the
// address back or is deleted. An ADD compares none is under WantedPrefix: when the other
// owner lets the address go, it stays the running pod's to take back, not the next ADD's.
func WantedKey(pool string, b allocator.Blocks, ip netip.Addr, cluster, owner string) string {
	return WantedPrefix(pool, b, ip) + cluster + "/" + owner
}

// WantedPrefix is the prefix of ip's wanted keys; with an invalid ip, of every one of pool's;
// with pool "" of every pool's.
func WantedPrefix(pool string, b allocator.Blocks, ip netip.Addr) string {
	switch {
	case pool == "":
		return wantedDir
	case !ip.IsValid():
		return wantedDir + pool + "/"
	}
	return wantedDir + pool + "/" + addrPart(b, ip) + "/"
}

// ParseWantedKey splits a wanted key into its pool, block, address, cluster and owner.
func ParseWantedKey(key string) (pool string, block netip.Prefix, ip netip.Addr, cluster, owner string, err error) {
	rest, ok := strings.CutPrefix(key, wantedDir)
	if !ok {
		return "", netip.Prefix{}, netip.Addr{}, "", "", fmt.Errorf("key %q is not under %s", key, wantedDir)
	}
	parts := strings.Split(rest, "/")
	if len(parts) < 4 {
		return "", netip.Prefix{}, netip.Addr{}, "", "", fmt.Errorf("key %q: want %s<pool>/[<block>/]<ip>/<cluster>/<owner>", key, wantedDir)
	}
	cluster, owner = parts[len(parts)-2], parts[len(parts)-1]
	pool, block, ip, err = parsePoolAddr(wantedDir, wantedDir+strings.Join(parts[:len(parts)-2], "/"))
	return pool, block, ip, cluster, owner, err
}

// OwnerKey is /leasehold/v1/owners/<cluster>/<owner>/<ifname>/<pool>: the owner index
// of one attachment, naming its addresses, on the pod lease.
func OwnerKey(cluster, owner, ifName, pool string) string {
	return ownersDir + cluster + "/" + owner + "/" + ifName + "/" + pool
}

// OwnerPrefix is the prefix of every attachment of one owner in cluster.
func OwnerPrefix(cluster, owner string) string { return ownersDir + cluster + "/" + owner + "/" }

// OwnersPrefix is the prefix of every owner index of cluster; with cluster "" of all clusters.
func OwnersPrefix(cluster string) string {
	if cluster == "" {
		return ownersDir
	}
	return ownersDir + cluster + "/"
}

// ConflictKey is /leasehold/v1/conflicts/<cluster>/<owner>/<ifname>/<pool>: an attachment
// whose addresses were taken by another owner while its lease was lost. It lives on the
// pod's lease, so it leaves with the pod.
func ConflictKey(cluster, owner, ifName, pool string) string {
	return conflictsDir + cluster + "/" + owner + "/" + ifName + "/" + pool
}

// ConflictsPrefix is the prefix of every conflict record of cluster; with cluster "" of all.
func ConflictsPrefix(cluster string) string {
	if cluster == "" {
		return conflictsDir
	}
	return conflictsDir + cluster + "/"
}

// NodeKey is /leasehold/v1/nodes/<cluster>/<node>: the agent's node record, on the node lease.
func NodeKey(cluster, node string) string { return nodesDir + cluster + "/" + node }

// RestoredKey is where an agent that found etcd gone back in time (restored from a backup)
// says so, on a lease of the settle time, for every agent of every cluster: one that saw no
// sign itself (a backup close to what it last saw) learns it there (RestoredRecord).
const RestoredKey = Prefix + "restored"

// NodesPrefix is the prefix of every node record of cluster; with cluster "" of all clusters.
func NodesPrefix(cluster string) string {
	if cluster == "" {
		return nodesDir
	}
	return nodesDir + cluster + "/"
}

// PodKey is /leasehold/v1/nodes/<cluster>/<node>/pods/<owner>: the pod record, on the pod lease.
func PodKey(cluster, node, owner string) string { return PodsPrefix(cluster, node) + owner }

// PodsPrefix is the prefix of every pod record of one node.
func PodsPrefix(cluster, node string) string { return nodesDir + cluster + "/" + node + "/pods/" }

// ParseIPKey splits an allocation key into its pool, its block (the zero Prefix in the flat
// layout) and its address.
func ParseIPKey(key string) (pool string, block netip.Prefix, ip netip.Addr, err error) {
	return parsePoolAddr(ipsDir, key)
}

// ParseQuarantineKey splits a quarantine key into its pool, block and address.
func ParseQuarantineKey(key string) (pool string, block netip.Prefix, ip netip.Addr, err error) {
	return parsePoolAddr(quarantineDir, key)
}

func parsePoolAddr(dir, key string) (string, netip.Prefix, netip.Addr, error) {
	rest, ok := strings.CutPrefix(key, dir)
	if !ok {
		return "", netip.Prefix{}, netip.Addr{}, fmt.Errorf("key %q is not under %s", key, dir)
	}
	parts := strings.Split(rest, "/")
	var block netip.Prefix
	switch len(parts) {
	case 2:
	case 3:
		b, err := ParseBlockName(parts[1])
		if err != nil {
			return "", netip.Prefix{}, netip.Addr{}, fmt.Errorf("key %q: %w", key, err)
		}
		block = b
	default:
		return "", netip.Prefix{}, netip.Addr{}, fmt.Errorf("key %q: want %s<pool>/<block>/<ip> or %s<pool>/<ip>", key, dir, dir)
	}
	ip, err := netip.ParseAddr(parts[len(parts)-1])
	if err != nil {
		return "", netip.Prefix{}, netip.Addr{}, fmt.Errorf("key %q: %w", key, err)
	}
	if block.IsValid() && !block.Contains(ip) {
		return "", netip.Prefix{}, netip.Addr{}, fmt.Errorf("key %q: address %s is not in block %s", key, ip, block)
	}
	return parts[0], block, ip, nil
}

// ParseOwnerKey splits an owner index key into its parts.
func ParseOwnerKey(key string) (cluster, owner, ifName, pool string, err error) {
	return parseAttachmentKey(key, ownersDir)
}

// ParseConflictKey splits a conflict record's key into its parts.
func ParseConflictKey(key string) (cluster, owner, ifName, pool string, err error) {
	return parseAttachmentKey(key, conflictsDir)
}

// parseAttachmentKey splits key, dir<cluster>/<owner>/<ifname>/<pool>, into its parts.
func parseAttachmentKey(key, dir string) (cluster, owner, ifName, pool string, err error) {
	rest, ok := strings.CutPrefix(key, dir)
	if !ok {
		return "", "", "", "", fmt.Errorf("key %q is not under %s", key, dir)
	}
	parts := strings.Split(rest, "/")
	if len(parts) != 4 {
		return "", "", "", "", fmt.Errorf("key %q: want %s<cluster>/<owner>/<ifname>/<pool>", key, dir)
	}
	return parts[0], parts[1], parts[2], parts[3], nil
}

// ValidateNames checks every name that becomes a key component, given as (what, name)
// pairs, and names the first bad one. Errors wrap allocator.ErrInvalidName.
func ValidateNames(pairs ...string) error {
	for i := 0; i+1 < len(pairs); i += 2 {
		if err := allocator.ValidateName(pairs[i], pairs[i+1]); err != nil {
			return err
		}
	}
	return nil
}

// RolePrefixes are the key prefixes one cluster's agents read and write: the shared ones
// (pool definitions, allocations, quarantine, held and wanted keys, block claims, host
// addresses, pool conflicts: one address
// has one owner across clusters, so every cluster must see them) and the cluster's own
// owners, nodes, conflicts, sticky claims and live migrations. An etcd role per cluster granting readwrite on exactly
// these, and read on ReadPrefixes, keeps a cluster's credentials away from other clusters'
// owners (deploy/etcd).
func RolePrefixes(cluster string) []string {
	return []string{
		poolsDir, ipsDir, quarantineDir, hostIPsDir, poolConflicts, blocksDir, heldDir, wantedDir,
		OwnersPrefix(cluster), NodesPrefix(cluster), ConflictsPrefix(cluster), ClaimsPrefix(cluster),
		LiveMigrationsPrefix(cluster),
	}
}

// ReadPrefixes are the key prefixes one cluster's agents only read: the cluster's selection
// rules, which admins write (leaseholdctl selection) and every agent follows. Read-only, so
// a node's credentials cannot change which pools other nodes' pods get.
func ReadPrefixes(cluster string) []string {
	return []string{SelectionPrefix(cluster, "")}
}
