package keyspace

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/leasehold/leasehold/allocator"
)

// The block layout (allocator.Blocks): a pool's addresses are grouped by block, so that one
// block is one contiguous etcd key range that its node watches alone.

// BlockName spells a block in keys: its prefix with "-" for "/", as 10.10.1.64-26 or
// fd10::40-122, so that a key stays one path component per part.
func BlockName(block netip.Prefix) string {
	return block.Addr().String() + "-" + strconv.Itoa(block.Bits())
}

// ParseBlockName reads a BlockName; the prefix must be masked (a block starts on its size).
func ParseBlockName(s string) (netip.Prefix, error) {
	i := strings.LastIndexByte(s, '-')
	if i < 0 {
		return netip.Prefix{}, fmt.Errorf("block %q: want <address>-<length>, as 10.10.1.64-26", s)
	}
	p, err := netip.ParsePrefix(s[:i] + "/" + s[i+1:])
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("block %q: %w", s, err)
	}
	if p.Masked() != p || BlockName(p) != s || p.Addr().Is4In6() || p.Addr().Zone() != "" {
		return netip.Prefix{}, fmt.Errorf("block %q is not spelled canonically (%s)", s, BlockName(p.Masked()))
	}
	return p, nil
}

// addrPart is the block and address part of an address's key: <block>/<ip> with the address
// in its one spelling (IPv4, not IPv4-mapped), or <ip> alone in the flat layout, spelled as
// the flat layout always did.
func addrPart(b allocator.Blocks, ip netip.Addr) string {
	if block := b.Of(ip); block.IsValid() {
		return BlockName(block) + "/" + ip.Unmap().String()
	}
	return ip.String()
}

// BlockKey is /leasehold/v1/blocks/<pool>/<block>: the node that claimed the block, on that
// node's block lease (see BlockRecord).
func BlockKey(pool string, block netip.Prefix) string { return BlocksPrefix(pool) + BlockName(block) }

// BlocksPrefix is the prefix of pool's block claims; with pool "" of every pool's.
func BlocksPrefix(pool string) string {
	if pool == "" {
		return blocksDir
	}
	return blocksDir + pool + "/"
}

// ParseBlockKey splits a block claim key into its pool and block.
func ParseBlockKey(key string) (pool string, block netip.Prefix, err error) {
	rest, ok := strings.CutPrefix(key, blocksDir)
	if !ok {
		return "", netip.Prefix{}, fmt.Errorf("key %q is not under %s", key, blocksDir)
	}
	pool, name, ok := strings.Cut(rest, "/")
	if !ok || strings.Contains(name, "/") {
		return "", netip.Prefix{}, fmt.Errorf("key %q: want %s<pool>/<block>", key, blocksDir)
	}
	block, err = ParseBlockName(name)
	if err != nil {
		return "", netip.Prefix{}, fmt.Errorf("key %q: %w", key, err)
	}
	return pool, block, nil
}

// BlockIPsPrefix is the key range of block's allocations: what its node watches.
func BlockIPsPrefix(pool string, block netip.Prefix) string {
	return IPsPrefix(pool) + BlockName(block) + "/"
}

// BlockQuarantinePrefix is the key range of block's quarantined addresses.
func BlockQuarantinePrefix(pool string, block netip.Prefix) string {
	return QuarantinePrefix(pool) + BlockName(block) + "/"
}

// BlockHeldPrefix is the key range of block's held keys.
func BlockHeldPrefix(pool string, block netip.Prefix) string {
	return HeldPrefix(pool) + BlockName(block) + "/"
}

// BlockRecord is the value of /leasehold/v1/blocks/<pool>/<block>: which node of which
// cluster claimed the block, with which identity, since when. It lives on the node's block
// lease, which its agent adopts again after a restart, so a dead node's blocks go with it, a
// reuse delay after its pods' leases (HeldKey).
type BlockRecord struct {
	Cluster string    `json:"cluster"`
	Node    string    `json:"node"`
	NodeUID string    `json:"nodeUID"`
	LeaseID string    `json:"leaseID"`
	Since   time.Time `json:"since"`
}
