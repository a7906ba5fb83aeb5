package txn

import (
	"net/netip"
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// elseResponse answers every read of c's else branch: the key named in found gets a value
// (its lease and ModRevision as given), every other read comes back empty, as etcd answers
// a failed transaction.
func elseResponse(c *Claim, found map[string]*mvccpb.KeyValue) *clientv3.TxnResponse {
	_, _, gets := c.ops()
	resp := &clientv3.TxnResponse{Header: &pb.ResponseHeader{Revision: 99}}
	for _, op := range gets {
		rr := &pb.RangeResponse{}
		if kv, ok := found[string(op.KeyBytes())]; ok {
			kv.Key = op.KeyBytes()
			rr.Kvs = []*mvccpb.KeyValue{kv}
		}
		resp.Responses = append(resp.Responses, &pb.ResponseOp{Response: &pb.ResponseOp_ResponseRange{ResponseRange: rr}})
	}
	return resp
}

// TestClaimOutcomeNamesWhatTheElseBranchFound checks the claim's shape and that each read of
// its else branch is decoded as the outcome it stands for, for an ADD of a new pod, an ADD of
// a known pod and a re-claim (no I/O: etcd's answers are built by hand).
func TestClaimOutcomeNamesWhatTheElseBranchFound(t *testing.T) {
	v4, v6 := netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("fd01::5")
	const lease, other = clientv3.LeaseID(7), clientv3.LeaseID(8)
	add := func(newPod bool) *Claim {
		return &Claim{Add: true, Lease: lease, Pool: "p", Blocks: allocator.DefaultBlocks, PoolRev: 40, Addrs: []netip.Addr{v4, v6},
			OwnerKey: keyspace.OwnerKey("c", "o", "eth0", "p"), PodKey: keyspace.PodKey("c", "n", "o"), NewPod: newPod}
	}
	reclaim := &Claim{Lease: lease, Pool: "p", Blocks: allocator.DefaultBlocks, Addrs: []netip.Addr{v4, v6}, OwnerKey: keyspace.OwnerKey("c", "o", "eth0", "p"),
		ConflictKey: keyspace.ConflictKey("c", "o", "eth0", "p"), Conflict: &keyspace.ConflictRecord{}}
	pool := &mvccpb.KeyValue{ModRevision: 40}
	tests := []struct {
		name             string
		c                *Claim
		cmps, puts, gets int
		found            map[string]*mvccpb.KeyValue
		want             func(t *testing.T, o ClaimOutcome)
	}{{
		// New pod: owner index, pool, pod record, then per address allocation, quarantine,
		// hosts, wanted keys.
		name: "ADD of a new pod whose v6 address rests in quarantine", c: add(true), cmps: 11, puts: 4, gets: 13,
		found: map[string]*mvccpb.KeyValue{keyspace.PoolKey("p"): pool, keyspace.QuarantineKey("p", allocator.DefaultBlocks, v6): {}},
		want: func(t *testing.T, o ClaimOutcome) {
			if o.Applied || o.Existing != nil || o.PoolChanged || o.Pod != PodAsExpected {
				t.Errorf("only the quarantine failed the claim; got %+v", o)
			}
			if o.Addrs[0].Taken() || o.Addrs[1].Quarantine == nil || o.Addrs[1].Holder != nil || o.Addrs[1].Host != nil {
				t.Errorf("addresses: want v4 free and v6 quarantined, got %+v", o.Addrs)
			}
		},
	}, {
		name: "ADD whose pool definition changed and whose v4 address a node publishes", c: add(true), cmps: 11, puts: 4, gets: 13,
		found: map[string]*mvccpb.KeyValue{keyspace.PoolKey("p"): {ModRevision: 41}, keyspace.HostIPPrefix(v4): {}},
		want: func(t *testing.T, o ClaimOutcome) {
			if !o.PoolChanged || o.Addrs[0].Host == nil || o.Addrs[1].Taken() {
				t.Errorf("want pool changed and v4 a host address, got %+v", o)
			}
		},
	}, {
		name: "ADD of a new pod that has a record from before the agent's memory", c: add(true), cmps: 11, puts: 4, gets: 13,
		found: map[string]*mvccpb.KeyValue{keyspace.PoolKey("p"): pool, keyspace.PodKey("c", "n", "o"): {Lease: int64(other)}},
		want: func(t *testing.T, o ClaimOutcome) {
			if o.Pod != PodExists || o.PodKV == nil {
				t.Errorf("want PodExists, got %v", o.Pod)
			}
		},
	}, {
		// Known pod: its record is compared on the lease, not created.
		name: "ADD of a known pod whose record is gone", c: add(false), cmps: 11, puts: 3, gets: 13,
		found: map[string]*mvccpb.KeyValue{keyspace.PoolKey("p"): pool},
		want: func(t *testing.T, o ClaimOutcome) {
			if o.Pod != PodGone {
				t.Errorf("want PodGone, got %v", o.Pod)
			}
		},
	}, {
		name: "ADD of a known pod whose record is on another lease, v6 held by another owner", c: add(false), cmps: 11, puts: 3, gets: 13,
		found: map[string]*mvccpb.KeyValue{keyspace.PoolKey("p"): pool, keyspace.PodKey("c", "n", "o"): {Lease: int64(other)},
			keyspace.IPKey("p", allocator.DefaultBlocks, v6): {CreateRevision: 12}},
		want: func(t *testing.T, o ClaimOutcome) {
			if o.Pod != PodMoved || o.Addrs[1].Holder == nil || o.Addrs[1].Holder.CreateRevision != 12 || o.Addrs[0].Taken() {
				t.Errorf("want PodMoved and v6 held, got %+v", o)
			}
		},
	}, {
		name: "ADD of a known pod on its lease, repeated: the owner index exists", c: add(false), cmps: 11, puts: 3, gets: 13,
		found: map[string]*mvccpb.KeyValue{keyspace.PoolKey("p"): pool, keyspace.PodKey("c", "n", "o"): {Lease: int64(lease)},
			keyspace.OwnerKey("c", "o", "eth0", "p"): {ModRevision: 30}},
		want: func(t *testing.T, o ClaimOutcome) {
			if o.Existing == nil || o.Existing.ModRevision != 30 || o.Pod != PodAsExpected || o.PoolChanged {
				t.Errorf("want the existing owner index only, got %+v", o)
			}
		},
	}, {
		name: "ADD whose v4 address a running pod wants back", c: add(true), cmps: 11, puts: 4, gets: 13,
		found: map[string]*mvccpb.KeyValue{keyspace.PoolKey("p"): pool, keyspace.WantedPrefix("p", allocator.DefaultBlocks, v4): {}},
		want: func(t *testing.T, o ClaimOutcome) {
			if o.Addrs[0].Wanted == nil || !o.Addrs[0].Taken() || o.Addrs[0].Holder != nil || o.Addrs[1].Taken() {
				t.Errorf("want v4 wanted back and v6 free, got %+v", o.Addrs)
			}
		},
	}, {
		// Re-claim: owner index and allocations only, and the conflict record among the puts.
		name: "re-claim whose v4 address another owner took", c: reclaim, cmps: 3, puts: 4, gets: 3,
		found: map[string]*mvccpb.KeyValue{keyspace.IPKey("p", allocator.DefaultBlocks, v4): {}},
		want: func(t *testing.T, o ClaimOutcome) {
			if o.PoolChanged || o.Pod != PodAsExpected || o.Addrs[0].Holder == nil || o.Addrs[1].Taken() {
				t.Errorf("want only v4 held, got %+v", o)
			}
		},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cmps, puts, gets := tt.c.ops()
			if len(cmps) != tt.cmps || len(puts) != tt.puts || len(gets) != tt.gets {
				t.Errorf("claim has %d compares, %d puts, %d reads; want %d, %d, %d", len(cmps), len(puts), len(gets), tt.cmps, tt.puts, tt.gets)
			}
			if last := puts[len(puts)-1]; tt.c.Conflict == nil && string(last.KeyBytes()) != tt.c.OwnerKey {
				t.Errorf("last put is %s; the owner index is written last", last.KeyBytes())
			}
			tt.want(t, tt.c.outcome(elseResponse(tt.c, tt.found)))
		})
	}
	ok := add(true).outcome(&clientv3.TxnResponse{Header: &pb.ResponseHeader{Revision: 99}, Succeeded: true})
	if !ok.Applied || ok.Revision != 99 {
		t.Errorf("a succeeded claim: want applied at 99, got %+v", ok)
	}
}

// TestImportClaimHasThePodRecordAndNoADDCompares checks an import's claim (leases/imports): the
// pod record is created with the attachment (or compared on the lease), and neither the pool
// definition nor quarantine or host keys are compared: the container uses its addresses already.
func TestImportClaimHasThePodRecordAndNoADDCompares(t *testing.T) {
	v4, v6 := netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("fd01::5")
	const lease, other = clientv3.LeaseID(7), clientv3.LeaseID(8)
	podKey := keyspace.PodKey("c", "n", "ctr")
	imp := func(newPod bool) *Claim {
		return &Claim{Lease: lease, Pool: "p", Blocks: allocator.DefaultBlocks, Addrs: []netip.Addr{v4, v6},
			OwnerKey: keyspace.OwnerKey("c", "ctr", "eth0", "p"), PodKey: podKey, NewPod: newPod}
	}
	for _, tt := range []struct {
		newPod bool
		puts   int
		found  map[string]*mvccpb.KeyValue
		want   func(ClaimOutcome) bool
	}{
		{true, 4, map[string]*mvccpb.KeyValue{podKey: {Lease: int64(other)}},
			func(o ClaimOutcome) bool {
				return o.Pod == PodExists && o.PodKV != nil && !o.Addrs[0].Taken() && !o.Addrs[1].Taken()
			}},
		{true, 4, map[string]*mvccpb.KeyValue{keyspace.IPKey("p", allocator.DefaultBlocks, v6): {CreateRevision: 3}},
			func(o ClaimOutcome) bool {
				return o.Pod == PodAsExpected && !o.Addrs[0].Taken() && o.Addrs[1].Holder != nil
			}},
		{false, 3, map[string]*mvccpb.KeyValue{},
			func(o ClaimOutcome) bool { return o.Pod == PodGone && !o.PoolChanged }},
		{false, 3, map[string]*mvccpb.KeyValue{podKey: {Lease: int64(lease)}, keyspace.OwnerKey("c", "ctr", "eth0", "p"): {ModRevision: 5}},
			func(o ClaimOutcome) bool {
				return o.Pod == PodAsExpected && o.Existing != nil && o.Existing.ModRevision == 5
			}},
	} {
		c := imp(tt.newPod)
		cmps, puts, gets := c.ops()
		if len(cmps) != 4 || len(puts) != tt.puts || len(gets) != 4 {
			t.Errorf("new pod %v: %d compares, %d puts, %d reads; want 4, %d, 4", tt.newPod, len(cmps), len(puts), len(gets), tt.puts)
		}
		if o := c.outcome(elseResponse(c, tt.found)); !tt.want(o) {
			t.Errorf("new pod %v, found %v: outcome %+v", tt.newPod, tt.found, o)
		}
	}
}
