package keyspace_test

import (
	"fmt"
	"net/netip"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// An allocation is one key per address, readable with plain etcdctl
// (etcdctl get --prefix /leasehold/v1/ips/net1/); ParseIPKey reads a key back. A pool in the
// flat layout (allocator.Blocks zero, pools stored before blocks) keys the address alone; a
// pool divided into blocks puts the address's block in between, so that a block's keys are
// one range its node watches (BlockIPsPrefix).
func ExampleIPKey() {
	for _, b := range []allocator.Blocks{{}, allocator.DefaultBlocks} {
		for _, ip := range []string{"10.10.1.70", "fd10::47"} {
			key := keyspace.IPKey("net1", b, netip.MustParseAddr(ip))
			pool, block, addr, err := keyspace.ParseIPKey(key)
			fmt.Println(key, pool, block, addr, err)
		}
	}
	fmt.Println(keyspace.BlockIPsPrefix("net1", netip.MustParsePrefix("10.10.1.64/26")))
	_, _, _, err := keyspace.ParseIPKey("/leasehold/v1/ips/net1/not-an-ip")
	fmt.Println(err)
	_, _, _, err = keyspace.ParseIPKey("/leasehold/v1/ips/net1/10.10.1.0-26/10.10.1.70")
	fmt.Println(err)
	// Output:
	// /leasehold/v1/ips/net1/10.10.1.70 net1 invalid Prefix 10.10.1.70 <nil>
	// /leasehold/v1/ips/net1/fd10::47 net1 invalid Prefix fd10::47 <nil>
	// /leasehold/v1/ips/net1/10.10.1.64-26/10.10.1.70 net1 10.10.1.64/26 10.10.1.70 <nil>
	// /leasehold/v1/ips/net1/fd10::40-122/fd10::47 net1 fd10::40/122 fd10::47 <nil>
	// /leasehold/v1/ips/net1/10.10.1.64-26/
	// key "/leasehold/v1/ips/net1/not-an-ip": ParseAddr("not-an-ip"): unable to parse IP
	// key "/leasehold/v1/ips/net1/10.10.1.0-26/10.10.1.70": address 10.10.1.70 is not in block 10.10.1.0/26
}

// A node claims a block with one key per block; the key names the block as its prefix with
// "-" for "/", which ParseBlockName reads back only in that one spelling.
func ExampleBlockKey() {
	block := allocator.DefaultBlocks.Of(netip.MustParseAddr("10.10.1.70"))
	key := keyspace.BlockKey("net1", block)
	fmt.Println(key)
	pool, b, err := keyspace.ParseBlockKey(key)
	fmt.Println(pool, b, err)
	_, err = keyspace.ParseBlockName("10.10.1.65-26")
	fmt.Println(err)
	// Output:
	// /leasehold/v1/blocks/net1/10.10.1.64-26
	// net1 10.10.1.64/26 <nil>
	// block "10.10.1.65-26" is not spelled canonically (10.10.1.64-26)
}

// The owner index of one attachment (a pod's interface on a pool) names its addresses; all
// attachments of one pod share the prefix OwnerPrefix, which is how a DEL counts what is left.
func ExampleOwnerKey() {
	key := keyspace.OwnerKey("prod", "8f3c2a6e-pod-uid", "eth0", "net1")
	fmt.Println(key)
	fmt.Println(keyspace.OwnerPrefix("prod", "8f3c2a6e-pod-uid"))
	cluster, owner, ifName, pool, err := keyspace.ParseOwnerKey(key)
	fmt.Println(cluster, owner, ifName, pool, err)
	// Output:
	// /leasehold/v1/owners/prod/8f3c2a6e-pod-uid/eth0/net1
	// /leasehold/v1/owners/prod/8f3c2a6e-pod-uid/
	// prod 8f3c2a6e-pod-uid eth0 net1 <nil>
}

// Decode reads the record at a key, as a program that watches the keys would. The lease ID is
// in etcdctl's hex form; ParseLeaseHex turns it back into a clientv3.LeaseID. A value that is
// not the record (a hand edit) is an error that names the key.
func ExampleDecode() {
	value := []byte(`{"owner":"8f3c2a6e-pod-uid","cluster":"prod","node":"worker-1","containerID":"c0ffee",` +
		`"ifName":"eth0","network":"net1","leaseID":"694d7b0b2c6e5a11","created":"2025-01-02T03:04:05Z"}`)
	a, err := keyspace.Decode[keyspace.Allocation](keyspace.IPKey("net1", allocator.Blocks{}, netip.MustParseAddr("10.10.1.7")), value)
	if err != nil {
		fmt.Println(err)
		return
	}
	lease, err := keyspace.ParseLeaseHex(a.LeaseID)
	fmt.Println(a.Owner, a.Node, a.IfName, int64(lease), err)

	_, err = keyspace.Decode[keyspace.Allocation]("/leasehold/v1/ips/net1/10.10.1.8", []byte("by hand"))
	fmt.Println(err)
	// Output:
	// 8f3c2a6e-pod-uid worker-1 eth0 7587856235109440017 <nil>
	// key /leasehold/v1/ips/net1/10.10.1.8 holds a value leasehold cannot read (invalid character 'b' looking for beginning of value); inspect it with: etcdctl get /leasehold/v1/ips/net1/10.10.1.8
}
