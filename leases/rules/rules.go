// Package rules follows one cluster's selection rules (package selection) as etcd has them:
// a listing, then a watch from the listing's revision; a watch that breaks (compaction, etcd
// restarted or restored) lists again. An ADD reads the rules it holds without asking etcd, so
// a rule change reaches the next ADD on every node within one watch round-trip, and costs an
// ADD nothing when no rule exists.
package rules

import (
	"context"
	"log/slog"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/selection"
)

// Retry bounds of a listing that failed.
const (
	retryFirst = 100 * time.Millisecond
	retryMax   = 5 * time.Second
)

// Follower holds one cluster's selection rules. Its goroutine is Run's.
type Follower struct {
	cli     *clientv3.Client
	cluster string
	log     *slog.Logger

	// listed is closed once the first listing is in.
	listed chan struct{}

	mu sync.Mutex
	// rules are the readable rules by key; bad the keys of unreadable ones, with why.
	rules map[string]keyspace.Rule
	bad   map[string]string
}

// New returns a follower of cluster's rules through cli (the gate's client); Run follows them.
func New(cli *clientv3.Client, cluster string, log *slog.Logger) *Follower {
	return &Follower{cli: cli, cluster: cluster, log: log, listed: make(chan struct{}),
		rules: map[string]keyspace.Rule{}, bad: map[string]string{}}
}

// Rules returns network's rules, and whether it has any. Before the first listing it waits
// for it, as long as ctx allows: an ADD must not choose by rules it has not read.
func (f *Follower) Rules(ctx context.Context, network string) (selection.Rules, bool, error) {
	select {
	case <-f.listed:
	case <-ctx.Done():
		return selection.Rules{}, false, ctx.Err()
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	var rs []keyspace.Rule
	for _, r := range f.rules {
		if r.Network == network {
			rs = append(rs, r)
		}
	}
	return selection.Gather(rs, f.cluster, network), len(rs) > 0, nil
}

// Run lists the rules and follows them until ctx ends.
func (f *Follower) Run(ctx context.Context) {
	prefix := keyspace.SelectionPrefix(f.cluster, "")
	backoff := retryFirst
	for ctx.Err() == nil {
		resp, err := f.cli.Get(ctx, prefix, clientv3.WithPrefix())
		if err != nil {
			f.log.Warn("listing the selection rules failed; ADDs choose by the rules last read", "err", err, "retry_in", backoff)
			select {
			case <-ctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, retryMax)
			continue
		}
		backoff = retryFirst
		f.mu.Lock()
		f.rules, f.bad = map[string]keyspace.Rule{}, map[string]string{}
		for _, kv := range resp.Kvs {
			f.putLocked(string(kv.Key), kv.Value)
		}
		f.mu.Unlock()
		select {
		case <-f.listed:
		default:
			close(f.listed)
		}
		f.follow(ctx, prefix, resp.Header.Revision+1)
	}
}

// follow applies the watch's events from rev on until it breaks or ctx ends.
func (f *Follower) follow(ctx context.Context, prefix string, rev int64) {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	for resp := range f.cli.Watch(wctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(rev)) {
		if err := resp.Err(); err != nil {
			if ctx.Err() == nil {
				f.log.Info("the watch of the selection rules broke; listing them again", "err", err)
			}
			return
		}
		f.mu.Lock()
		for _, ev := range resp.Events {
			key := string(ev.Kv.Key)
			if ev.Type == clientv3.EventTypeDelete {
				delete(f.rules, key)
				delete(f.bad, key)
				continue
			}
			f.putLocked(key, ev.Kv.Value)
		}
		f.mu.Unlock()
	}
}

// putLocked records the rule stored at key; one that cannot be read is passed over, with a
// warning once per value. The caller holds mu.
func (f *Follower) putLocked(key string, value []byte) {
	r, err := keyspace.DecodeRule(key, value)
	if err != nil {
		delete(f.rules, key)
		if f.bad[key] != err.Error() {
			f.log.Warn("a selection rule cannot be read; ADDs pass it over", "err", err)
		}
		f.bad[key] = err.Error()
		return
	}
	delete(f.bad, key)
	f.rules[key] = r
}
