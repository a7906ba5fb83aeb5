package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
)

// restore is the etcd-restore fault, as etcd's disaster recovery guide does it for a
// three-member cluster: a snapshot saved from one member; p.Dur later (pods created and
// deleted meanwhile) every member's data lost; each member restored from that one snapshot
// with the same --initial-cluster and token into a fresh data directory (plainly, or with
// --bump-revision 1000000000 --mark-compacted as Kubernetes' guides advise), and started
// again at the same URLs. The agents run on throughout.
func (in *injector) restore(ctx context.Context, p faultPlan, f *Fault) {
	e, c := in.e, in.e.etcd
	src := c.members[p.Member]
	in.e.rec.faultUpdate(f, func(f *Fault) { f.Way, f.NewToken, f.Target = p.Way, p.NewToken, "all" })
	file := filepath.Join(e.dir, "etcd", fmt.Sprintf("backup-%d.db", p.ID))
	in.started(f, time.Now())
	if out, err := c.etcdctl(ctx, 30*time.Second, []string{src.client}, "snapshot", "save", file); err != nil {
		in.skip(f, fmt.Sprintf("etcdctl snapshot save from %s: %v: %s", src.name, err, out))
		return
	}
	saved := time.Now()
	rev, err := snapshotRevision(ctx, filepath.Join(e.cfg.Bin, "etcdutl"), file)
	if err != nil {
		in.skip(f, err.Error())
		return
	}
	in.e.rec.faultUpdate(f, func(f *Fault) { f.BackupDone, f.BackupRev = saved, rev })
	in.note(f, "backup from %s at revision %d", src.name, rev)
	if !sleepCtx(ctx, p.Dur) {
		in.skip(f, "the fault phase ended before the restore")
		return
	}

	// From here on etcd must serve again, whatever the fault phase does.
	rctx, cancel := revertCtx()
	defer cancel()
	in.restoring.Store(true)
	defer in.restoring.Store(false)
	lost := time.Now()
	for _, m := range c.members {
		if err := c.kill(m); err != nil {
			in.note(f, "kill %s: %v", m.name, err)
		}
	}
	in.e.rec.faultUpdate(f, func(f *Fault) { f.Lost = lost })
	if p.NewToken {
		c.token = fmt.Sprintf("lhchaos-%d-restore-%d", e.topo.X, p.ID)
	}
	var wg sync.WaitGroup
	errs := make([]error, len(c.members))
	for i, m := range c.members {
		wg.Go(func() {
			m.mu.Lock()
			defer m.mu.Unlock()
			old := m.data
			m.data = filepath.Join(e.etcdData, fmt.Sprintf("%s-restore-%d.data", m.name, p.ID))
			args := []string{"snapshot", "restore", file, "--data-dir", m.data, "--name", m.name,
				"--initial-cluster", c.initial, "--initial-cluster-token", c.token, "--initial-advertise-peer-urls", m.peer}
			if p.Way == RestoreBump {
				args = append(args, "--bump-revision", "1000000000", "--mark-compacted")
			}
			uctx, cancel := context.WithTimeout(rctx, 60*time.Second)
			defer cancel()
			out, err := exec.CommandContext(uctx, filepath.Join(e.cfg.Bin, "etcdutl"), args...).CombinedOutput()
			if err != nil {
				errs[i] = fmt.Errorf("etcdutl %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
				m.data = old
				return
			}
			m.args = c.memberArgs(m)
			_ = os.RemoveAll(old) // the lost data: never read again
			appendLine(m.logPath, fmt.Sprintf("=== chaos: restored %s from %s (%s) into %s", m.name, file, p.Way, m.data))
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			// The member starts on its old data: the run goes on, but the fault failed.
			in.e.rec.event(Event{Time: time.Now(), Kind: "fault-error", Slot: -1, Detail: err.Error(), Fails: true})
		}
	}
	for _, m := range c.members {
		if err := c.start(m); err != nil {
			in.note(f, "start %s: %v", m.name, err)
		}
	}
	if !c.healthy(rctx, 60*time.Second) {
		in.note(f, "the restored cluster was not healthy within 60s")
	}
	back := time.Now()
	in.ended(f, back)
	gctx, gcancel := context.WithTimeout(rctx, 5*time.Second)
	resp, err := e.cli.Get(gctx, "/chaos-restore-probe")
	gcancel()
	if err == nil {
		in.e.rec.faultUpdate(f, func(f *Fault) { f.RestoredRev = resp.Header.Revision })
		in.note(f, "%s restore: etcd lost at %s, serving again after %s at revision %d, cluster %x",
			p.Way, offset(in.start, lost), back.Sub(lost).Round(100*time.Millisecond), resp.Header.Revision, resp.Header.ClusterId)
	}
}

// snapshotRevision is the revision a snapshot file holds (etcdutl snapshot status).
func snapshotRevision(ctx context.Context, etcdutl, file string) (int64, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, etcdutl, "snapshot", "status", file, "-w", "json").Output()
	if err != nil {
		return 0, fmt.Errorf("etcdutl snapshot status %s: %v", file, err)
	}
	var st struct {
		Revision int64 `json:"revision"`
	}
	if err := json.Unmarshal(out, &st); err != nil {
		return 0, fmt.Errorf("etcdutl snapshot status %s: %v: %s", file, err, out)
	}
	return st.Revision, nil
}

// keyEdit is the key-edit fault: an admin's etcdctl del of one key of a running pod of the
// node (p.Key), or with p.Put an etcdctl put of the key's own value without its lease; then
// the run watches (keyWatch) for the key to be back on a lease with the pod's value.
func (in *injector) keyEdit(ctx context.Context, p faultPlan, f *Fault, n *node, rng *rand.Rand) {
	e := in.e
	k := e.rt.kubelets[n.slot]
	// The first of a few running pods whose key is in place (one being re-claimed, or in a
	// conflict, has none to change).
	var pod *Pod
	var key string
	var kv *keyValue
	var why []string
	for _, pc := range k.pickLive(rng, 5) {
		gctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		found, v, err := in.podKey(gctx, pc.rec, p.Key)
		cancel()
		if err == nil && v != nil && v.Lease != 0 {
			pod, key, kv = pc.rec, found, v
			break
		}
		why = append(why, fmt.Sprintf("%s: %v", pc.rec.UID, err))
	}
	if pod == nil {
		in.skip(f, fmt.Sprintf("no running pod's %s in place to change (%s)", p.Key, strings.Join(why, "; ")))
		return
	}
	op := "del"
	args := []string{"del", key}
	if p.Put {
		op, args = "put", []string{"put", key, string(kv.Value)}
	}
	in.e.rec.faultUpdate(f, func(f *Fault) { f.Key, f.Op, f.Path, f.Pod = p.Key, op, key, pod.UID })
	t := time.Now()
	in.started(f, t)
	if out, err := e.etcd.etcdctl(ctx, 10*time.Second, e.etcd.endpoints(), args...); err != nil {
		in.note(f, "etcdctl %s: %v: %s", op, err, out)
		in.ended(f, time.Now())
		return
	}
	want := podValue(pod, p.Key, key)
	back := poll(ctx, keyWatch(e.cfg.TTL), 200*time.Millisecond, func() bool {
		gctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		resp, err := e.cli.Get(gctx, key)
		return err == nil && len(resp.Kvs) == 1 && resp.Kvs[0].Lease != 0 && want(resp.Kvs[0].Value)
	})
	now := time.Now()
	in.ended(f, now)
	if back {
		in.e.rec.faultUpdate(f, func(f *Fault) { f.Back = now })
		in.note(f, "etcdctl %s of %s's %s; back on a lease after %s", op, pod.UID, p.Key, now.Sub(t).Round(100*time.Millisecond))
	} else {
		in.note(f, "etcdctl %s of %s's %s; not back on a lease within %s", op, pod.UID, p.Key, keyWatch(e.cfg.TTL))
	}
}

// podKey finds the key of kind of pod in etcd (cluster "default", interface eth0, the run's
// pool): the allocation is found by its owner among the pool's.
func (in *injector) podKey(ctx context.Context, pod *Pod, kind string) (string, *keyValue, error) {
	e := in.e
	var key string
	switch kind {
	case KeyOwnerIndex:
		key = keyspace.OwnerKey("default", pod.UID, "eth0", e.pool)
	case KeyPodRecord:
		key = keyspace.PodKey("default", pod.Node, pod.UID)
	default:
		resp, err := e.cli.Get(ctx, ipsPrefix+e.pool+"/", clientv3.WithPrefix())
		if err != nil {
			return "", nil, err
		}
		for _, kv := range resp.Kvs {
			if a, ok := parseAlloc(kv.Key, kv.Value, kv.Lease); ok && a.Owner == pod.UID {
				return string(kv.Key), &keyValue{Value: kv.Value, Lease: kv.Lease}, nil
			}
		}
		return "", nil, fmt.Errorf("no allocation of %s", pod.UID)
	}
	resp, err := e.cli.Get(ctx, key)
	if err != nil {
		return key, nil, err
	}
	if len(resp.Kvs) == 0 {
		return key, nil, fmt.Errorf("%s missing", key)
	}
	return key, &keyValue{Value: resp.Kvs[0].Value, Lease: resp.Kvs[0].Lease}, nil
}

type keyValue struct {
	Value []byte
	Lease int64
}

// podValue tells whether a value of a key of kind is pod's: the allocation and the pod
// record name its owner, the owner index its container.
func podValue(pod *Pod, kind, key string) func([]byte) bool {
	return func(b []byte) bool {
		switch kind {
		case KeyOwnerIndex:
			r, err := keyspace.Decode[keyspace.OwnerRecord](key, b)
			return err == nil && r.ContainerID == pod.Container
		case KeyPodRecord:
			r, err := keyspace.Decode[keyspace.PodRecord](key, b)
			return err == nil && r.Owner == pod.UID
		}
		r, err := keyspace.Decode[keyspace.Allocation](key, b)
		return err == nil && r.Owner == pod.UID
	}
}
