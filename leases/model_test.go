package leases

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/netip"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/keyspace"
)

// modelCISeed is the history CI runs: one with every kind of step, cut-offs longer and
// shorter than the reuse delay among them.
const modelCISeed = 1005

// TestModelRandomHistories drives several agents and owners through random interleavings of
// ADD, DEL, CHECK, GC, agent restarts, lease losses, node drains, node deaths, cut-offs and
// crashes against the real etcd, records the history, and after every step checks the state
// against a simple model. The pool has small blocks (model_blocks_test.go), so histories
// claim blocks, fill them, borrow in other nodes' blocks when every block is claimed, and
// give empty blocks back; a dead node's leases expire with its pods and block claims, and it
// comes back replaced. A few owners are StatefulSet pods whose attachments name a sticky claim
// (model_sticky_test.go): each deletion, drain, GC or node death of one is followed by a new
// incarnation (a new pod UID, on any node) that must get the claim's addresses, and an
// incarnation created while another lives must be refused; two of them are VMs, whose claims
// are migratable: a new incarnation on another node while one lives is a live migration's
// target, which the source's DEL completes and the target's DEL fails (model_migration_test.go).
// A node is sometimes cut off
// (model_cutoff_test.go): its agent killed, its pod leases expired, its pods' addresses held
// back for the reuse delay, sometimes longer; it comes back with the same identity and
// re-claims its pods. An agent is sometimes killed right after a DEL's answer, and a DEL
// sometimes races the re-claim of its pod's lost lease (model_del_test.go). An admin sometimes
// deletes or overwrites a key of a running pod with etcdctl (model_audit_test.go), and etcd
// sometimes goes back to a backup of an earlier step, restored the two ways etcd documents,
// while the agents run (model_restore_test.go). Each pod's interface net2 is on a dual-stack
// network whose rule gives IPv4 and IPv6 from two pools, an attachment in each, both or
// neither, through all of the above (model_dual_test.go). A history ends by bringing every
// cut-off node back, deleting every attachment and letting the claims' holds run out (settle).
//
//   - every check is address by address, in the pool that holds the address: an attachment
//     of net2 has an owner index and conflict record per pool; an ADD of net2 answers an
//     IPv4 and an IPv6 address, each listed by its pool's owner index, or, refused, leaves no
//     key of the interface in any pool (details in model_dual_test.go);
//   - at most one owner per address: every allocation key is named by exactly one owner index
//     on the same lease, and no two owner indexes name one address of a pool but a running
//     pod's, which lists an address another owner took while the pod's node was away (a
//     conflict); no ADD returns an address the model gives to another attachment;
//   - ADD is idempotent: an ADD for an attachment the model holds returns its addresses;
//   - release is owner-compared: a DEL, GC or stale DEL never removes another owner's keys;
//   - quarantine is respected: a released address goes to no other owner before it ends;
//   - keys are in their blocks: every allocation and quarantine key lies in the block its key
//     names, which is the pool's block of the address;
//   - block claims are sound: each is on a live lease and names a live node of the model, or
//     a cut-off one within its reuse delay; no two agents consider one block theirs, and each
//     agent's blocks are its claims;
//   - a dead node leaves nothing behind: every key naming it goes with its leases;
//   - claims are sound: an ADD naming a claim is refused exactly while another live
//     incarnation holds it, else gets the claim record's addresses; a claim holder's owner
//     index lists and names the claim, unless its node is dead or cut off; a claim-marked
//     quarantine key and an allocation of one address imply the claim's holder owns it; no
//     ADD without the claim gets its addresses (details in model_sticky_test.go);
//   - live migrations: a migration pair is one owner: at most one migration key per claim, on
//     its target's pod lease, on another node than the holder's, under a migratable record;
//     the allocation keys are the holder's, the owner indexes listing the addresses the
//     holder's and the target's; a third incarnation, or one on the holder's node, is refused
//     naming the holder (details in model_migration_test.go);
//   - the reuse order: an ADD returns an address held back for a cut-off node's pod only when
//     the pool had fewer free addresses no expired holder had than the step ran ADDs;
//   - held keys are sound: a running pod's addresses have held keys of its owner and node on
//     a block lease its agent renews; a cut-off node's pods have no key but those, until its
//     reuse delay runs out, then none;
//   - coming back: a cut-off node re-claims every pod with every address nobody took; each one
//     taken is a conflict (Conflicts(), the conflict record, CHECK code 104), and no other is;
//     every owner index and conflict record stands for an attachment of the model; once the
//     other owner lets a conflicted address go, the running pod holds it again within
//     modelResolveWait;
//   - a DEL answered is final: after the agent is killed right after its answer (the pod
//     leases expiring or not meanwhile), or when it races a re-claim, the attachment has no
//     key and its agent does not know it, then or a little later; its held keys are freed,
//     and the node's other pods are kept (details in model_del_test.go);
//   - a live lease is not proof: a key of a running pod deleted or overwritten by hand is put
//     back on a new lease of the pod (an address another owner took is a conflict, resolved
//     once that owner lets it go), and no ADD gets the pod's addresses meanwhile; after etcd
//     went back to a backup, every agent holds every pod of its node again, answers ADDs
//     again, and what the backup brought back of deleted pods goes with its leases; no ADD,
//     then or later, gets an address of another running attachment (details in
//     model_audit_test.go and model_restore_test.go);
//   - no leak: once every attachment is deleted, no allocation and no held key is left, and
//     every block is given back when its quarantine and BlockIdle are over.
//
// A simpler model than a linearizability checker (porcupine) suffices because every
// invariant is a predicate over etcd's state at quiet points between steps, and every
// operation of one owner is serialised by its agent; etcd's own linearizability is etcd's
// to prove. The seed is printed on failure; LEASEHOLD_MODEL_SEED replays it and
// LEASEHOLD_MODEL_STEPS runs longer (make soak). Each run draws a new seed, except in CI
// (CI set): there the seed is modelCISeed, so that a change is judged by the same history
// each time and a new seed's find is a bug filed, not a red build on someone else's change.
func TestModelRandomHistories(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	if os.Getenv("CI") != "" {
		seed = modelCISeed
	}
	if s := os.Getenv("LEASEHOLD_MODEL_SEED"); s != "" {
		seed, _ = strconv.ParseUint(s, 10, 64)
	}
	steps := 150
	if s := os.Getenv("LEASEHOLD_MODEL_STEPS"); s != "" {
		steps, _ = strconv.Atoi(s)
	}
	m := newModel(t, seed)
	defer func() {
		if t.Failed() {
			t.Logf("replay with LEASEHOLD_MODEL_SEED=%d; last steps:\n%s\nblocks:%s", seed, m.tail(400), m.blocksDump())
		}
	}()
	for i := range steps {
		m.step(i)
		m.awaitCompletions(i)
		m.resolve(i)
		m.noteContended()
		m.check()
		if t.Failed() {
			return
		}
	}
	m.settle(steps)
	if t.Failed() {
		return
	}
	tot := m.totals()
	t.Logf("seed %d: %d steps, %d ADDs (%d refused: %v), %d DELs, %d GCs, %d restarts, %d lease losses, "+
		"%d drains, %d node deaths (%d replaced); %v block claims, %v blocks given back, %v addresses borrowed; "+
		"%d claims left to expire by restarted nodes at the end; sticky: %d ADDs of new incarnations, %d hand-overs "+
		"(%d from a dead node's pod, %d racing the DEL of the one before; agents counted %v), %d refused while an incarnation lived "+
		"(agents counted %v)", seed, steps,
		m.count["add"], m.count["add refused"], m.refusals(), m.count["del"], m.count["gc"], m.count["restart"],
		m.count["lose"], m.count["drain"], m.count["death"], m.count["replace"],
		tot["leasehold_block_claims_total"], tot["leasehold_blocks_given_back_total"], tot["leasehold_borrowed_addresses_total"],
		m.count["orphaned"], m.count["sticky add"], m.count["handover"], m.count["handover from a dead node"], m.count["sticky add racing a DEL"],
		tot["leasehold_claim_handovers_total"], m.count["sticky refused"], tot["leasehold_claim_handovers_refused_total"])
	t.Logf("seed %d: cut-offs: %d (%d shorter than the reuse delay, %d longer), %d held-back addresses reused for lack of room "+
		"(agents counted %v), %d taken after the delay, %d conflicts seen on coming back (agents counted %v re-claiming), "+
		"%d resolved (agents counted %v); %d crashes right after a DEL, %d DELs racing a re-claim", seed,
		m.count["cut-off"], m.count["cut-off short"], m.count["cut-off long"], m.count["reuse"], tot["leasehold_expired_addresses_reused_total"],
		m.count["taken after the delay"], m.count["conflict"], tot["leasehold_conflicts_total"], m.count["resolved"],
		tot["leasehold_conflicts_resolved_total"], m.count["crash after DEL"], m.count["del during re-claim"])
	t.Logf("seed %d: keys of running pods changed by hand: %d (%d deleted, %d overwritten with the pod's value without its lease, "+
		"%d with another owner's; agents counted %v keys lost); %d backups, %d restores (%d plain, %d bumped; agents noticed "+
		"%v times), %d conflicts after a restore, %d block leases nobody renewed revoked after a restore, %d sticky claims lost with a restore (every agent that took one "+
		"died since); agents re-claimed pods %v times; %d changes of the pool's access or rules, %d ADDs refused by a closed pool", seed,
		m.count["tamper"], m.count["tamper: "+tamperDeleted], m.count["tamper: "+tamperOwnValue], m.count["tamper: "+tamperOtherOwner],
		tot["leasehold_pod_keys_lost_total"], m.count["backup"], m.count["restore"], m.count["restore plain"], m.count["restore bumped"],
		tot["leasehold_etcd_went_back_total"], m.count["conflict after a restore"], m.count["unrenewed block lease after a restore"],
		m.count["claim lost with a restore"], tot["leasehold_reclaims_total"], m.count["access"], m.count["add refused: pool closed"])
	t.Logf("seed %d: interfaces with IPv4 and IPv6 from two pools: %d new ones served (%d with IPv4 from the next pool, the small one full), "+
		"%d refused", seed, m.count["dual add"], m.count["dual fallback"], m.count["dual refused"])
	if m.count["dual add"] == 0 {
		t.Errorf("seed %d: no interface got its IPv4 and IPv6 from two pools in %d steps: the history did not exercise them", seed, steps)
	}
	t.Logf("seed %d: live migrations: %d started, %d completed, %d failed, %d promoted after the source's node died, %d after a fault "+
		"took the source's keys, %d ended by the target's node dying; refused: %d third incarnations, %d on the holder's node; %d started "+
		"after a restore", seed, m.count["migration started"],
		m.count["migration completed"], m.count["migration failed"], m.count["migration promoted"],
		m.count["migration promoted after a fault"], m.count["migration target died"],
		m.count["migration refused: "+migThird], m.count["migration refused: "+migSame], m.count["migration started after a restore"])
	if m.count["migration started"] == 0 {
		t.Errorf("seed %d: no live migration started in %d steps: the history did not exercise migrations", seed, steps)
	}
	if m.count["access"] == 0 {
		t.Errorf("seed %d: the pool's access and rules never changed in %d steps: the history did not exercise closed pools", seed, steps)
	}
	if m.count["tamper"] == 0 {
		t.Errorf("seed %d: no key of a running pod was deleted or overwritten in %d steps: the history did not exercise the audit", seed, steps)
	}
	if m.count["restore plain"] == 0 || m.count["restore bumped"] == 0 {
		t.Errorf("seed %d: etcd went back to a backup %d times plainly and %d times with its revision bumped in %d steps: "+
			"the history did not exercise both restores", seed, m.count["restore plain"], m.count["restore bumped"], steps)
	}
	if m.count["cut-off"] == 0 {
		t.Errorf("seed %d: no node was cut off in %d steps: the history did not exercise the reuse delay", seed, steps)
	}
	if m.count["handover"] == 0 {
		t.Errorf("seed %d: no sticky claim was handed over in %d steps: the history did not exercise claims", seed, steps)
	}
}

const modelQuarantine = 2 * time.Second

// modelStepTimeout bounds one step or settle of a history: far above what the slowest run
// needs, so that only an operation that never ends runs out of it.
const modelStepTimeout = 3 * etcdtest.Patience

type modelNode struct {
	name, uid, state string
	agent            *Agent // nil while the node is dead or cut off
	gen              int    // replacements so far: the node UID's suffix
	back             int    // the step a dead node comes back at, replaced
	// A cut-off node (model_cutoff_test.go): the step it comes back at (0: connected), the
	// step its reuse delay runs out at (0: it comes back first), whether its block leases
	// still hold its pods' addresses back, and those leases.
	away, expireAt int
	holdsBack      bool
	blockLeases    []clientv3.LeaseID
}

type attKey struct{ owner, ifName string }

type model struct {
	t       *testing.T
	rng     *rand.Rand
	cluster string
	pool    allocator.PoolSpec
	spec    allocator.PoolSpec // the pool, canonical: its sizes
	cli     *clientv3.Client
	nodes   []*modelNode
	home    map[string]int           // owner -> node index
	held    map[attKey][]netip.Addr  // what the model believes each attachment holds
	ctr     map[attKey]string        // its container ID
	freed   map[netip.Addr]time.Time // address -> when its holder released it
	// Sticky claims (model_sticky_test.go): each StatefulSet incarnation's ordinal, each
	// ordinal's incarnations so far, and its claim's addresses once known.
	stsOf    map[string]string
	stsGen   map[string]int
	claimIPs map[string][]netip.Addr
	history  []string
	count    map[string]int
	errs     map[string]int     // why new ADDs were refused
	stats    map[string]float64 // block counters of agents gone (model_blocks_test.go)
	mu       sync.Mutex

	// Cut-offs (model_cutoff_test.go): the addresses of each attachment that another owner
	// holds (taken while its node was away), the addresses whose last holder expired without
	// a release, and, for the running step, the never-held free addresses per range set
	// before it (nil: none is held back) and its ADDs.
	conflict map[attKey][]netip.Addr
	expired  map[netip.Addr]bool
	// For each attachment of a cut-off node, the addresses another owner was given while it
	// was away (taken), and those another attachment listed at the end of a step meanwhile
	// (contended: it may have held them between two steps).
	awayTaken map[attKey][]netip.Addr
	contended map[attKey]map[netip.Addr]bool
	neverHeld map[string][]int // by pool
	stepAdds  int

	// Issue 32 (model_audit_test.go, model_restore_test.go): the model's etcd member, the
	// allocations another owner put over a running pod's (by address), the leases the model
	// let expire, the backups taken so far, and whether a step's ADDs run while the agents
	// repair what a restore took (they may be refused then).
	etcd      *etcdtest.Member
	intruders map[netip.Addr]modelIntruder
	revoked   map[clientv3.LeaseID]bool
	backupDir string
	backups   []modelBackup
	repairing bool

	// The node identities ("name/uid") whose agents took each ordinal's claim for an
	// incarnation, and so keep it or remember its release (model_sticky_test.go).
	claimTakers map[string]map[string]bool

	// Each VM ordinal's live migration target (model_migration_test.go), kept apart from
	// held: its holder's addresses, which the pair holds as one owner; and the sources a
	// fault displaced, their target promoted, until the model deletes them.
	targets   map[string]modelTarget
	displaced map[string]attKey
	completed []string // the ordinals whose migration a source's DEL completed in this step

	// The pool's access and the selection rules, as last written, and the step the pool
	// opens again at (model_access_test.go).
	access   modelAccess
	reopenAt int

	// The dual-stack network and its pools (model_dual_test.go); pools are every pool of the
	// model, canonical, m.spec first.
	dual  modelDual
	pools []allocator.PoolSpec
}

func newModel(t *testing.T, seed uint64) *model {
	m := &model{t: t, rng: rand.New(rand.NewPCG(seed, seed^0x5eed)), cluster: etcdtest.Uniq("model"),
		pool: modelPool(), home: map[string]int{}, held: map[attKey][]netip.Addr{},
		ctr: map[attKey]string{}, freed: map[netip.Addr]time.Time{}, count: map[string]int{}, errs: map[string]int{},
		stats: map[string]float64{}, stsOf: map[string]string{}, stsGen: map[string]int{}, claimIPs: map[string][]netip.Addr{},
		conflict: map[attKey][]netip.Addr{}, expired: map[netip.Addr]bool{}, awayTaken: map[attKey][]netip.Addr{},
		contended: map[attKey]map[netip.Addr]bool{}, intruders: map[netip.Addr]modelIntruder{}, revoked: map[clientv3.LeaseID]bool{},
		claimTakers: map[string]map[string]bool{}, targets: map[string]modelTarget{}, displaced: map[string]attKey{}}
	// etcd of the model's own, which it backs up and restores (model_restore_test.go).
	m.etcd = etcdtest.StartMember(t)
	m.cli = etcdtest.ClientAt(t, m.etcd.ClientURL)
	m.backupDir = t.TempDir()
	m.spec = modelPool()
	m.spec.Name = m.pool.Name
	if err := m.spec.Canonicalize(); err != nil {
		t.Fatal(err)
	}
	m.pools = []allocator.PoolSpec{m.spec}
	m.startDual()
	for i := range 3 {
		n := &modelNode{name: fmt.Sprintf("n%d", i), uid: fmt.Sprintf("uid%d", i), state: t.TempDir()}
		n.agent = m.start(n)
		m.nodes = append(m.nodes, n)
	}
	return m
}

func (m *model) start(n *modelNode) *Agent {
	return startAgentAt(m.t, m.etcd.ClientURL, m.cluster, n.name, n.uid, func(c *Config) {
		c.StateDir, c.Quarantine, c.GCGrace, c.LivenessInterval = n.state, modelQuarantine, -1, -1
		c.BlockIdle, c.ClaimHold, c.ReuseDelay = modelBlockIdle, modelClaimHold, modelReuseDelay
		c.AuditInterval = modelAuditInterval
	})
}

func (m *model) log(format string, args ...any) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.history = append(m.history, fmt.Sprintf(format, args...))
}

func (m *model) tail(n int) string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return strings.Join(m.history[max(0, len(m.history)-n):], "\n")
}

func (m *model) req(k attKey, container string) allocator.Request {
	net := m.netOf(k)
	r := allocator.Request{Network: net.Name, Pool: net, ContainerID: container, IfName: k.ifName,
		Pod: allocator.PodRef{UID: k.owner, Namespace: "ns", Name: k.owner}}
	if ord := m.ordinalOf(k.owner); ord != "" && !isDual(k) {
		r.Pod.Name, r.Claim, r.Migratable = ord, modelClaim(ord), modelVM(ord)
	}
	return r
}

// modelOp is one planned operation of a step: op on attachment k at node, or, with sticky
// set, the ADD of a new incarnation k of that StatefulSet ordinal.
type modelOp struct {
	node   *modelNode
	k      attKey
	op     int
	roll   int // drawn when planned, not in the goroutine: the generator is not shared
	sticky string
	// afterDel: the sticky ADD runs at once with the DEL of the ordinal's live incarnation.
	afterDel bool
	// mig: a live migration's operation on VM ordinal sticky (model_migration_test.go).
	mig string
}

// expectAdds records, for admitLocked, the room the pool had (neverHeldFree) before the
// step's adds new ADDs. Every kind of step that runs ADDs calls it: a value left from an
// earlier step would judge them against another pool.
func (m *model) expectAdds(free map[string][]int, adds int) {
	m.mu.Lock()
	m.neverHeld, m.stepAdds = free, adds
	m.mu.Unlock()
}

// step runs one to three random operations at once, on distinct owners.
func (m *model) step(i int) {
	ctx, cancel := context.WithTimeout(context.Background(), modelStepTimeout)
	defer cancel()
	m.revive(i)
	m.returns(ctx, i, false)
	m.evict(ctx, i, false)
	m.reopen(ctx, i)
	switch r := m.rng.IntN(100); {
	case r < 4:
		m.restart(i)
		return
	case r < 8:
		m.lose(ctx, i)
		return
	case r < 11:
		m.gc(ctx, i)
		return
	case r < 14:
		if m.die(ctx, i) {
			return
		}
	case r < 17:
		m.drain(ctx, i)
		return
	case r < 22:
		if m.cutOff(ctx, i) {
			return
		}
	case r < 25:
		if m.crashAfterDel(ctx, i) {
			return
		}
	case r < 28:
		if m.delDuringReclaim(ctx, i) {
			return
		}
	case r < 34:
		if m.tamper(ctx, i) {
			return
		}
	case r < 37:
		if m.restore(ctx, i) {
			return
		}
	case r < 41:
		m.backup(ctx, i) // then the step's operations
	case r < 44:
		m.changeAccess(ctx, i) // then the step's operations (model_access_test.go)
	}
	free := m.neverHeldFree(ctx)
	// Plan the whole step first: its operations run at once on distinct owners (and
	// distinct StatefulSet ordinals). The pods of a cut-off node are out of reach.
	var plan []modelOp
	used := map[string]bool{}
	for range 1 + m.rng.IntN(3) {
		if m.rng.IntN(4) == 0 {
			plan = append(plan, m.planSticky(used)...)
			continue
		}
		k := attKey{owner: fmt.Sprintf("pod%02d", m.rng.IntN(24)), ifName: modelIfNames[m.rng.IntN(len(modelIfNames))]}
		if used[k.owner] || m.awayOwner(k.owner) {
			continue
		}
		used[k.owner] = true
		op := m.rng.IntN(10)
		if free != nil && op >= 5 && op < 7 {
			op = 0 // more ADDs while a cut-off node holds addresses back: the pool runs out
		}
		plan = append(plan, modelOp{node: m.homeOf(k.owner), k: k, op: op, roll: m.rng.IntN(4)})
	}
	adds := 0
	for _, p := range plan {
		if p.mig == "" && (p.sticky != "" || p.op < 5) {
			adds++
		}
	}
	m.expectAdds(free, adds)
	var wg sync.WaitGroup
	for _, p := range plan {
		if p.mig != "" {
			wg.Go(func() { m.migrate(ctx, i, p) })
			continue
		}
		if p.sticky != "" {
			wg.Go(func() { m.stickyAdd(ctx, i, p.node, p.k, p.sticky, p.afterDel) })
			continue
		}
		wg.Go(func() { m.do(ctx, i, p.node, p.k, p.op, p.roll, used) })
	}
	wg.Wait()
}

// do runs one operation; busy names the owners with an operation in this step (their keys
// may change concurrently, so the DEL check leaves them out).
func (m *model) do(ctx context.Context, i int, node *modelNode, k attKey, op, roll int, busy map[string]bool) {
	m.mu.Lock()
	held, have := m.held[k]
	container := m.ctr[k]
	m.mu.Unlock()
	switch {
	case op < 5: // ADD: a new attachment, or a retry of an existing one
		if !have {
			container = fmt.Sprintf("%s-%s-%d", k.owner, k.ifName, i)
		}
		start := time.Now()
		res, err := node.agent.Add(ctx, m.req(k, container))
		m.log("%d %s ADD %v %s -> %v %v", i, node.name, k, container, addrs(res), err)
		m.inc("add")
		if isDual(k) {
			m.checkDualAdd(ctx, i, k, have, addrs(res), err) // both or neither (model_dual_test.go)
		}
		if err != nil {
			switch {
			case m.refusedForRepair(node.agent, err, start):
				// etcd went back in time: the node answers once its pods hold their
				// addresses again, and claims no block meanwhile (model_restore_test.go).
			case !have && !isDual(k) && m.refusedClosed(err):
				return // the pool is closed to new addresses (model_access_test.go)
			case !have && isDual(k) && (m.refusedDualClosed(err) || m.repairing && errors.Is(err, allocator.ErrInvalidConfig)):
				// Its IPv6 pool is closed; or etcd went back to a backup whose rule and
				// pools the agent has not read yet (model_dual_test.go).
				return
			case have:
				m.t.Errorf("step %d: repeated ADD of %v failed: %v", i, k, err)
			case !errors.Is(err, allocator.ErrPoolExhausted):
				// The model injects no other etcd fault: a pool with room must serve.
				m.t.Errorf("step %d: ADD of %v refused, not for exhaustion: %v", i, k, err)
			}
			m.refused(err)
			return
		}
		got := addrs(res)
		if !have && !isDual(k) && m.closedToNew() {
			m.t.Errorf("step %d: ADD of new %v got %v from pool %s, closed to new addresses", i, k, got, m.pool.Name)
		}
		if have && fmt.Sprint(got) != fmt.Sprint(held) {
			m.t.Errorf("step %d: ADD of %v is not idempotent: had %v, got %v", i, k, held, got)
		}
		m.mu.Lock()
		m.admitLocked(i, k, got, attKey{})
		for _, a := range got {
			// A repeated ADD answers what the pod has, a conflicted address included.
			if ord := m.claimOfAddrLocked(a); ord != "" && m.stsOf[k.owner] != ord && !slices.Contains(m.conflict[k], a) {
				m.t.Errorf("step %d: ADD of %v returned %s, an address of claim %s", i, k, a, modelClaim(ord))
			}
			if at, ok := m.freed[a]; ok && !have && time.Since(at) < modelQuarantine {
				m.t.Errorf("step %d: %s handed to %v %s after its release, inside the %s quarantine", i, a, k, time.Since(at), modelQuarantine)
			}
			delete(m.freed, a)
		}
		m.held[k], m.ctr[k] = got, container
		m.mu.Unlock()
	case op < 8: // DEL, sometimes replayed for an older container (must release nothing)
		stale := have && roll == 0
		c := container
		switch {
		case !have:
			c = fmt.Sprintf("%s-%s-never", k.owner, k.ifName) // DEL of what was never added
		case stale:
			c = container + "-old" // a replayed DEL of an earlier sandbox
		}
		before := m.keysOfOthers(busy)
		sent := time.Now()
		err := node.agent.Del(ctx, m.req(k, c))
		m.log("%d %s DEL %v %s stale=%v -> %v", i, node.name, k, c, stale || !have, err)
		m.inc("del")
		if err != nil {
			m.t.Errorf("step %d: DEL %v: %v", i, k, err)
			return
		}
		after := m.keysOfOthers(busy)
		for key, rev := range before {
			if after[key] != rev {
				m.t.Errorf("step %d: DEL of %v %s changed another owner's %s", i, k, c, key)
			}
		}
		if have && !stale {
			m.release(k, held, sent)
		}
	default: // CHECK
		res, err := node.agent.Check(ctx, m.req(k, container))
		m.log("%d %s CHECK %v -> %v %v", i, node.name, k, addrs(res), err)
		m.mu.Lock()
		taken := m.conflict[k]
		settling := slices.ContainsFunc(taken, func(a netip.Addr) bool { h, ok := m.holderLocked(a); return !ok || busy[h.owner] })
		m.mu.Unlock()
		switch {
		case !have || settling:
			// An address the other owner lets go in this step may be back already.
		case len(taken) > 0 && !errors.Is(err, allocator.ErrConflict):
			m.t.Errorf("step %d: CHECK of %v, whose %v another owner holds: %v, want a conflict", i, k, taken, err)
		case len(taken) == 0 && err != nil:
			m.t.Errorf("step %d: CHECK of held %v: %v", i, k, err)
		case len(taken) == 0 && !slices.Equal(addrs(res), held):
			m.t.Errorf("step %d: CHECK of held %v answered %v, want %v", i, k, addrs(res), held)
		}
	}
}

func (m *model) inc(what string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.count[what]++
}

// release records that k's addresses held were released by an operation sent at sent: their
// quarantine runs from the release transaction inside it, so from no earlier than sent. (From
// when the answer came, a busy machine could make a hand-over after the quarantine look early.)
func (m *model) release(k attKey, held []netip.Addr, sent time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.completeLocked(k) { // a live migration's source: its target holds them now
		held = nil
	}
	for _, a := range held {
		if !slices.Contains(m.conflict[k], a) { // another owner's
			m.freed[a] = sent
		}
	}
	delete(m.held, k)
	delete(m.ctr, k)
	delete(m.conflict, k)
}

// refused notes why a new ADD was refused.
func (m *model) refused(err error) {
	why := "other"
	switch {
	case errors.Is(err, allocator.ErrPoolExhausted):
		why = "exhausted"
	case errors.Is(err, allocator.ErrUnavailable):
		why = "unavailable"
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.count["add refused"]++
	m.errs[why]++
}

func (m *model) refusals() map[string]int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return maps.Clone(m.errs)
}

// restart stops one agent and starts it again with the same identity and state directory.
func (m *model) restart(i int) {
	live := m.live()
	n := m.nodes[live[m.rng.IntN(len(live))]]
	m.harvest(n.agent)
	n.agent.Close()
	n.agent = m.start(n)
	m.log("%d %s RESTART", i, n.name)
	m.count["restart"]++
}

// lose revokes one held pod lease behind its agent's back, as etcd does when the agent is
// away longer than the TTL; the agent must re-claim the pod's addresses. A live migration's
// source or target is one of the pods (awaitMigrations: the migration goes on, or its target
// was promoted meanwhile).
func (m *model) lose(ctx context.Context, i int) {
	owners := make([]string, 0, len(m.home))
	for owner := range m.home {
		owners = append(owners, owner)
	}
	sort.Strings(owners)
	start := m.rng.IntN(len(owners) + 1)
	for j := range owners {
		owner := owners[(start+j)%len(owners)]
		ni := m.home[owner]
		if m.nodes[ni].agent == nil {
			continue // a dead node's pods are gone
		}
		lease, ok := m.nodes[ni].agent.pods.Lease(owner)
		if !ok {
			continue
		}
		m.revoke(ctx, i, lease)
		m.nodes[ni].agent.keeper.MarkLost(lease) // found at once, not at its next keep-alive
		m.log("%d LOSE lease of %s on %s", i, owner, m.nodes[ni].name)
		m.count["lose"]++
		// The model's expectation stays: the agent re-claims (no ADD runs meanwhile, and
		// other nodes hold the addresses back), unless a running pod waiting for one of them
		// (a conflict) takes it back first.
		m.awaitMigrations(i, "the lease of "+owner+" was lost")
		m.awaitReclaims(i, ni)
		m.endDisplaced(ctx, i)
		return
	}
}

// gc runs CNI GC on one node with a random part of its attachments listed as valid.
func (m *model) gc(ctx context.Context, i int) {
	live := m.live()
	ni := live[m.rng.IntN(len(live))]
	valid := map[bool][]allocator.Attachment{} // by isDual
	var dropped []attKey
	m.mu.Lock()
	keys := make([]attKey, 0, len(m.ctr))
	for k := range m.ctr {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(a, b int) bool { return keys[a].owner+keys[a].ifName < keys[b].owner+keys[b].ifName })
	for _, k := range keys {
		c := m.ctr[k]
		if m.home[k.owner] != ni {
			continue
		}
		if m.rng.IntN(2) == 0 || m.stsOf[k.owner] != "" && m.targetAwayLocked(m.stsOf[k.owner]) {
			valid[isDual(k)] = append(valid[isDual(k)], allocator.Attachment{ContainerID: c, IfName: k.ifName})
		} else {
			dropped = append(dropped, k)
		}
	}
	for _, tgt := range m.targets {
		if m.home[tgt.k.owner] == ni { // a migration's target stays (its DEL is migrate's)
			valid[false] = append(valid[false], allocator.Attachment{ContainerID: tgt.ctr, IfName: tgt.k.ifName})
		}
	}
	held := map[attKey][]netip.Addr{}
	for _, k := range dropped {
		held[k] = m.held[k]
	}
	m.mu.Unlock()
	sent := time.Now()
	// Each network's GC: the other's attachments are not its to collect.
	for _, net := range []allocator.PoolSpec{m.pool, m.dual.net} {
		dual := net.Name == m.dual.net.Name
		err := m.nodes[ni].agent.GC(ctx, allocator.GCRequest{Network: net.Name, Pool: net, ValidAttachments: valid[dual]})
		m.log("%d %s GC of %s valid=%d dropped=%v -> %v", i, m.nodes[ni].name, net.Name, len(valid[dual]),
			slices.DeleteFunc(slices.Clone(dropped), func(k attKey) bool { return isDual(k) != dual }), err)
		if err != nil {
			m.t.Errorf("step %d: GC of %s: %v", i, net.Name, err)
		}
	}
	m.count["gc"]++
	for _, k := range dropped {
		m.release(k, held[k], sent)
	}
}

// keysOfOthers returns the allocation keys, with their revisions, of owners not in busy.
func (m *model) keysOfOthers(busy map[string]bool) map[string]int64 {
	ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
	defer cancel()
	resp, err := m.cli.Txn(ctx).Then(m.poolOps(func(p allocator.PoolSpec) string { return keyspace.IPsPrefix(p.Name) })...).Commit()
	if err != nil {
		m.t.Fatal(err)
	}
	out := map[string]int64{}
	for _, r := range resp.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			if a, err := keyspace.Decode[keyspace.Allocation](string(kv.Key), kv.Value); err == nil && !busy[a.Owner] {
				out[string(kv.Key)] = kv.ModRevision
			}
		}
	}
	return out
}

// check compares etcd with the model at a quiet point.
func (m *model) check() {
	ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Patience)
	defer cancel()
	// The owner indexes and claims, then per pool its allocations, quarantine keys and block
	// claims.
	ops := []clientv3.Op{clientv3.OpGet(keyspace.OwnersPrefix(m.cluster), clientv3.WithPrefix()),
		clientv3.OpGet(keyspace.ClaimsPrefix(m.cluster), clientv3.WithPrefix())}
	ops = append(ops, m.poolOps(func(p allocator.PoolSpec) string { return keyspace.IPsPrefix(p.Name) })...)
	ops = append(ops, m.poolOps(func(p allocator.PoolSpec) string { return keyspace.QuarantinePrefix(p.Name) })...)
	ops = append(ops, m.poolOps(func(p allocator.PoolSpec) string { return keyspace.BlocksPrefix(p.Name) })...)
	ops = append(ops, clientv3.OpGet(keyspace.LiveMigrationsPrefix(m.cluster), clientv3.WithPrefix()))
	resp, err := m.cli.Txn(ctx).Then(ops...).Commit()
	if err != nil {
		m.t.Fatal(err)
	}
	np := len(m.pools)
	kvsOf := func(what, pool int) []*mvccpb.KeyValue { return resp.Responses[2+what*np+pool].GetResponseRange().Kvs }
	allocLease := map[netip.Addr]int64{}
	for pi, p := range m.pools {
		for _, kv := range kvsOf(0, pi) {
			_, block, ip, err := keyspace.ParseIPKey(string(kv.Key))
			if err != nil {
				m.t.Errorf("allocation key: %v", err)
				continue
			}
			if _, dup := allocLease[ip]; dup {
				m.t.Errorf("%s has two allocation keys", ip)
			}
			allocLease[ip] = kv.Lease
			m.checkKeyBlocks(p, string(kv.Key), block, ip, keyspace.IPKey(p.Name, p.Blocks, ip))
		}
		for _, kv := range kvsOf(1, pi) {
			_, block, ip, err := keyspace.ParseQuarantineKey(string(kv.Key))
			if err != nil {
				m.t.Errorf("quarantine key: %v", err)
				continue
			}
			m.checkKeyBlocks(p, string(kv.Key), block, ip, keyspace.QuarantineKey(p.Name, p.Blocks, ip))
		}
		m.checkClaims(ctx, p, kvsOf(2, pi))
	}
	m.checkSticky(resp.Responses[1].GetResponseRange().Kvs, kvsOf(0, 0), resp.Responses[0].GetResponseRange().Kvs, kvsOf(1, 0))
	migs := resp.Responses[len(ops)-1].GetResponseRange().Kvs
	m.checkMigrations(resp.Responses[1].GetResponseRange().Kvs, kvsOf(0, 0), resp.Responses[0].GetResponseRange().Kvs, migs)
	targets := m.targetOwnerKeys(migs)
	m.checkViews()
	st := m.readState(ctx)
	m.mu.Lock()
	defer m.mu.Unlock()
	// An address another owner took while its pod's node was away stays in that pod's owner
	// index: checked with the conflicts (checkHolds).
	lost := map[string][]netip.Addr{}
	for k, taken := range m.conflict {
		for _, a := range taken {
			lost[m.ownerKeyAt(k, a)] = append(lost[m.ownerKeyAt(k, a)], a)
		}
	}
	namedBy := map[netip.Addr]string{}
	for _, kv := range resp.Responses[0].GetResponseRange().Kvs {
		rec, err := keyspace.Decode[keyspace.OwnerRecord](string(kv.Key), kv.Value)
		if err != nil {
			m.t.Error(err)
			continue
		}
		if _, ok := targets[string(kv.Key)]; ok {
			continue // a live migration's target: its holder's addresses (checkMigrations)
		}
		for _, ip := range rec.IPs {
			if slices.Contains(lost[string(kv.Key)], ip) {
				continue
			}
			if other, dup := namedBy[ip]; dup {
				m.t.Errorf("%s is named by two owner indexes: %s and %s", ip, other, kv.Key)
			}
			namedBy[ip] = string(kv.Key)
			if allocLease[ip] != kv.Lease {
				m.t.Errorf("%s: owner index %s on lease %x, allocation on %x", ip, kv.Key, kv.Lease, allocLease[ip])
			}
		}
	}
	for ip := range allocLease {
		if _, ok := namedBy[ip]; !ok && !m.intrudedLocked(ip) {
			m.t.Errorf("allocation %s is named by no owner index", ip)
		}
		delete(m.expired, ip) // allocated again: whoever held it back knows
	}
	for k, held := range m.held {
		if m.awayLocked(k) {
			continue // its keys expired: checkHolds
		}
		for _, ip := range held {
			if !slices.Contains(m.conflict[k], ip) && namedBy[ip] != m.ownerKeyAt(k, ip) {
				m.t.Errorf("model: %v holds %s, etcd: %q", k, ip, namedBy[ip])
			}
		}
	}
	m.checkHolds(st)
}

func addrs(res allocator.Result) []netip.Addr {
	out := make([]netip.Addr, 0, len(res.IPs))
	for _, c := range res.IPs {
		out = append(out, c.Address.Addr())
	}
	return out
}
