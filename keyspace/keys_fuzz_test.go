package keyspace

import (
	"net/netip"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/leasehold/leasehold/allocator"
)

// FuzzKeys checks the key schema for every combination of names allocator.ValidateName
// accepts (others are skipped: no key is ever built from them) and any address:
//
//   - every key starts with Prefix, is valid UTF-8, has no empty, "." or ".." component
//     and no trailing '/', and has exactly the components its family documents
//     (ips/<pool>/<ip> is 3, owners/<c>/<o>/<if>/<pool> is 5, ...), each equal to the
//     name it was built from;
//   - the Parse*Key functions invert the builders: ParseIPKey(IPKey(p, ip)) == (p, ip),
//     ParseQuarantineKey likewise, ParseOwnerKey(OwnerKey(c, o, i, p)) == (c, o, i, p),
//     ParseHostIPKey(HostIPKey(ip, c, n)) == ip;
//   - no confusion between names: a key built from a second set of names falls under a
//     prefix built from the first (IPsPrefix, OwnerPrefix, PodsPrefix, NodesPrefix,
//     HostIPPrefix, PoolConflictsPrefix, ...) exactly when the names it is keyed by are
//     equal, so "net1" never reads or deletes "net10"'s keys, and 10.0.0.1 never
//     matches 10.0.0.10.
//
// Names ValidateName refuses are mapped onto its alphabet (fuzzName), so that every
// input exercises the keys; accepted names are used as they are.
// Addresses are built from raw bytes (4 or 16, no zone); requests cannot carry a zoned
// address to a key (the agent refuses it as in no range; see integration's hostile test).
// Seeds: testdata/fuzz/FuzzKeys.
func FuzzKeys(f *testing.F) {
	f.Add("default", "node-a", "uid-1", "eth0", "net1", []byte{10, 0, 0, 1}, "default", "uid-1", "net10", []byte{10, 0, 0, 10})
	f.Add("c", "n", "o", "i", "p", []byte{0xfd, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2}, "c2", "o", "p", []byte{0xfd, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x20})
	f.Fuzz(func(t *testing.T, cluster, node, owner, ifName, pool string, ipb []byte, cluster2, owner2, pool2 string, ipb2 []byte) {
		for _, n := range []*string{&cluster, &node, &owner, &ifName, &pool, &cluster2, &owner2, &pool2} {
			*n = fuzzName(*n)
			if err := allocator.ValidateName("fuzz", *n); err != nil {
				t.Fatalf("fuzzName made an invalid name: %v", err)
			}
		}
		ip, ok := fuzzAddr(ipb)
		ip2, ok2 := fuzzAddr(ipb2)
		if !ok || !ok2 {
			return
		}

		shapes := []struct {
			key  string
			want []string // components after Prefix
		}{
			{IPKey(pool, ip), []string{"ips", pool, ip.String()}},
			{QuarantineKey(pool, ip), []string{"quarantine", pool, ip.String()}},
			{OwnerKey(cluster, owner, ifName, pool), []string{"owners", cluster, owner, ifName, pool}},
			{ConflictKey(cluster, owner, ifName, pool), []string{"conflicts", cluster, owner, ifName, pool}},
			{NodeKey(cluster, node), []string{"nodes", cluster, node}},
			{PodKey(cluster, node, owner), []string{"nodes", cluster, node, "pods", owner}},
			{PoolKey(pool), []string{"pools", pool}},
			{HostIPKey(ip, cluster, node), []string{"hostips", ip.String(), cluster, node}},
			{PoolConflictKey(pool, cluster, node), []string{"poolconflicts", pool, cluster, node}},
		}
		for _, s := range shapes {
			rest, ok := strings.CutPrefix(s.key, Prefix)
			if !ok {
				t.Errorf("key %q is outside %s", s.key, Prefix)
				continue
			}
			if !utf8.ValidString(s.key) {
				t.Errorf("key %q is not valid UTF-8", s.key)
			}
			parts := strings.Split(rest, "/")
			if len(parts) != len(s.want) {
				t.Errorf("key %q has %d components, want %d (%q)", s.key, len(parts), len(s.want), s.want)
				continue
			}
			for i, p := range parts {
				if p == "" || p == "." || p == ".." {
					t.Errorf("key %q has component %q", s.key, p)
				}
				if p != s.want[i] {
					t.Errorf("key %q: component %d is %q, want %q", s.key, i, p, s.want[i])
				}
			}
		}

		if p, a, err := ParseIPKey(IPKey(pool, ip)); err != nil || p != pool || a != ip {
			t.Errorf("ParseIPKey(IPKey(%q, %s)) = %q, %s, %v", pool, ip, p, a, err)
		}
		if p, a, err := ParseQuarantineKey(QuarantineKey(pool, ip)); err != nil || p != pool || a != ip {
			t.Errorf("ParseQuarantineKey(QuarantineKey(%q, %s)) = %q, %s, %v", pool, ip, p, a, err)
		}
		if c, o, i, p, err := ParseOwnerKey(OwnerKey(cluster, owner, ifName, pool)); err != nil ||
			c != cluster || o != owner || i != ifName || p != pool {
			t.Errorf("ParseOwnerKey(OwnerKey(%q, %q, %q, %q)) = %q, %q, %q, %q, %v", cluster, owner, ifName, pool, c, o, i, p, err)
		}
		if a, err := ParseHostIPKey(HostIPKey(ip, cluster, node)); err != nil || a != ip {
			t.Errorf("ParseHostIPKey(HostIPKey(%s, %q, %q)) = %s, %v", ip, cluster, node, a, err)
		}
		// A key of one family never parses as another's.
		if _, _, err := ParseIPKey(QuarantineKey(pool, ip)); err == nil {
			t.Errorf("ParseIPKey accepted quarantine key %q", QuarantineKey(pool, ip))
		}
		if _, _, _, _, err := ParseOwnerKey(ConflictKey(cluster, owner, ifName, pool)); err == nil {
			t.Errorf("ParseOwnerKey accepted conflict key %q", ConflictKey(cluster, owner, ifName, pool))
		}

		under := func(what, key, prefix string, want bool) {
			if got := strings.HasPrefix(key, prefix); got != want {
				t.Errorf("%s: key %q under prefix %q is %v, want %v", what, key, prefix, got, want)
			}
		}
		under("IPsPrefix", IPKey(pool2, ip), IPsPrefix(pool), pool2 == pool)
		under("IPsPrefix(all)", IPKey(pool2, ip2), IPsPrefix(""), true)
		under("QuarantinePrefix", QuarantineKey(pool2, ip), QuarantinePrefix(pool), pool2 == pool)
		under("OwnerPrefix", OwnerKey(cluster2, owner2, ifName, pool), OwnerPrefix(cluster, owner), cluster2 == cluster && owner2 == owner)
		under("OwnersPrefix", OwnerKey(cluster2, owner, ifName, pool), OwnersPrefix(cluster), cluster2 == cluster)
		under("ConflictsPrefix", ConflictKey(cluster2, owner, ifName, pool), ConflictsPrefix(cluster), cluster2 == cluster)
		under("NodesPrefix", NodeKey(cluster2, node), NodesPrefix(cluster), cluster2 == cluster)
		under("PodsPrefix", PodKey(cluster2, node, owner2), PodsPrefix(cluster, node), cluster2 == cluster)
		under("PodsPrefix vs node key", NodeKey(cluster, node), PodsPrefix(cluster, node), false)
		under("HostIPPrefix", HostIPKey(ip2, cluster, node), HostIPPrefix(ip), ip2 == ip)
		under("PoolConflictsPrefix", PoolConflictKey(pool2, cluster, node), PoolConflictsPrefix(pool), pool2 == pool)
		under("PoolsPrefix", PoolKey(pool2), PoolsPrefix(), true)
		// Families never nest: no key of one family lies under another family's prefix.
		under("IPsPrefix vs quarantine", QuarantineKey(pool, ip), IPsPrefix(""), false)
		under("OwnersPrefix vs conflicts", ConflictKey(cluster, owner, ifName, pool), OwnersPrefix(""), false)
		under("PoolsPrefix vs poolconflicts", PoolConflictKey(pool, cluster, node), PoolsPrefix(), false)
	})
}

// fuzzAddr makes an address of 4 or 16 bytes; 16 bytes may be an IPv4-mapped address,
// which keys keep as it is.
func fuzzAddr(b []byte) (netip.Addr, bool) {
	switch {
	case len(b) >= 16:
		return netip.AddrFrom16([16]byte(b[:16])), true
	case len(b) >= 4:
		return netip.AddrFrom4([4]byte(b[:4])), true
	}
	return netip.Addr{}, false
}

// fuzzName returns s when ValidateName accepts it, else s mapped onto the accepted
// alphabet: at most MaxNameLen bytes, starting with a letter or digit.
func fuzzName(s string) string {
	if allocator.ValidateName("fuzz", s) == nil {
		return s
	}
	const alnum = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
	const rest = alnum + "._:@-"
	if len(s) > allocator.MaxNameLen {
		s = s[:allocator.MaxNameLen]
	}
	if s == "" {
		return "x"
	}
	b := []byte(s)
	b[0] = alnum[int(b[0])%len(alnum)]
	for i := 1; i < len(b); i++ {
		b[i] = rest[int(b[i])%len(rest)]
	}
	return string(b)
}
