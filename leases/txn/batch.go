package txn

import (
	"context"
	"slices"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
)

// Batcher commits the agent's claim transactions. A claim that finds no transaction in
// flight goes to etcd at once, alone: a sequential ADD waits for nothing. Claims that arrive
// while one is in flight queue up and then go to etcd together, as one transaction holding
// all their compares and all their puts. Each transaction costs etcd a proposal, a WAL write
// and an apply; under a burst, one for several ADDs.
//
// All of a batch's compares must hold for it to commit. If one does not (an address another
// agent took, a pool changed), each claim of the batch runs again alone, with its own else
// branch, and learns what it would have learned. If the batch's answer is lost, every claim of
// it is ambiguous, and each ADD handles that as it handles its own lost answer (the claim
// loop, leases/claimloop): the lease stays with the owner and the claim is sent again,
// which finds the owner index if the lost one applied
// (TestEtcdLeaderKilledDuringABurstAndTheWholeClusterDown).
type Batcher struct {
	cli *clientv3.Client
	cfg BatcherConfig

	mu    sync.Mutex
	busy  bool
	queue []*queued
}

// queued is one claim waiting in the batcher, and then its answer.
type queued struct {
	cmps       []clientv3.Cmp
	puts, gets []clientv3.Op
	keys       []string // the keys put, which may appear once in a transaction
	resp       *clientv3.TxnResponse
	err        error
	done       chan struct{}
}

// BatcherConfig is what a Batcher needs from the agent, its signal included.
type BatcherConfig struct {
	// Timeout bounds each transaction the batcher runs for queued claims.
	Timeout time.Duration
	// OnBatch, if not nil, is told what came of each transaction that carried the claims of
	// several callers: "committed" (with the claims it carried), "split" (a compare failed, or
	// etcd refused the batch: each claim ran again alone) or "lost" (no answer). It is called
	// on the batch's goroutine, before its claims are answered: it must not block.
	OnBatch func(result string, claims int)
}

// NewBatcher returns the batcher of the claims sent to etcd through cli.
func NewBatcher(cli *clientv3.Client, cfg BatcherConfig) *Batcher {
	return &Batcher{cli: cli, cfg: cfg}
}

// Commit sends cl, alone or in a batch, and returns its outcome as its own transaction would
// have: a batch that commits applies every claim in it, at its revision. An error is as
// Claim.Commit's, and also ctx's when cl's caller gave up while cl waited in the queue.
func (b *Batcher) Commit(ctx context.Context, cl *Claim) (ClaimOutcome, error) {
	cmps, puts, gets := cl.ops()
	resp, err := b.commit(ctx, cmps, puts, gets)
	if err != nil {
		return ClaimOutcome{}, err
	}
	return cl.outcome(resp), nil
}

// CommitJoint sends parts, the claims of one interface's attachments in several pools, as
// one queued claim: they apply together or not at all. A batch that fails is split into its
// queued claims, never into the parts of one; a refusal's else branch is read per part. It
// returns each part's outcome, in order, as Commit does one claim's.
func (b *Batcher) CommitJoint(ctx context.Context, parts []*Claim) ([]ClaimOutcome, error) {
	cmps, puts, gets, nget := jointOps(parts)
	resp, err := b.commit(ctx, cmps, puts, gets)
	if err != nil {
		return nil, err
	}
	return jointOutcomes(parts, resp, nget), nil
}

// CommitParts runs parts, as CommitJoint sends them, as their own transaction: the parts of
// an ADD naming a sticky claim, which goes alone as Claim.Commit says.
func CommitParts(ctx context.Context, cli *clientv3.Client, parts []*Claim) ([]ClaimOutcome, error) {
	cmps, puts, gets, nget := jointOps(parts)
	resp, err := cli.Txn(ctx).If(cmps...).Then(puts...).Else(gets...).Commit()
	if err != nil {
		return nil, err
	}
	return jointOutcomes(parts, resp, nget), nil
}

// jointOps is the compares, puts and else-branch reads of parts as one transaction, and the
// count of each part's reads.
func jointOps(parts []*Claim) (cmps []clientv3.Cmp, puts, gets []clientv3.Op, nget []int) {
	nget = make([]int, len(parts))
	for i, cl := range parts {
		c, p, g := cl.ops()
		cmps, puts, gets, nget[i] = append(cmps, c...), append(puts, p...), append(gets, g...), len(g)
	}
	return cmps, puts, gets, nget
}

// jointOutcomes reads each part's outcome from resp, the answer to jointOps' transaction.
func jointOutcomes(parts []*Claim, resp *clientv3.TxnResponse, nget []int) []ClaimOutcome {
	outs := make([]ClaimOutcome, len(parts))
	off := 0
	for i, cl := range parts {
		part := &clientv3.TxnResponse{Header: resp.Header, Succeeded: resp.Succeeded}
		if !resp.Succeeded {
			part.Responses = resp.Responses[off : off+nget[i]]
		}
		off += nget[i]
		outs[i] = cl.outcome(part)
	}
	return outs
}

// commit runs a claim's transaction (its compares, puts and else-branch reads), alone or in
// a batch, and returns what that transaction alone would have: on success a response with the
// batch's header and no operation results (a claim reads none), otherwise its own response.
func (b *Batcher) commit(ctx context.Context, cmps []clientv3.Cmp, puts, gets []clientv3.Op) (*clientv3.TxnResponse, error) {
	c := &queued{cmps: cmps, puts: puts, gets: gets, done: make(chan struct{})}
	for _, op := range puts {
		c.keys = append(c.keys, string(op.KeyBytes()))
	}
	b.mu.Lock()
	if b.busy {
		b.queue = append(b.queue, c)
		b.mu.Unlock()
		select {
		case <-c.done:
			return c.resp, c.err
		case <-ctx.Done():
			// The ADD's deadline came first (etcd slow or away). A claim still queued is
			// withdrawn; one already sent may yet apply, and the caller treats the error as
			// an unanswered claim either way.
			b.mu.Lock()
			b.queue = slices.DeleteFunc(b.queue, func(q *queued) bool { return q == c })
			b.mu.Unlock()
			return nil, ctx.Err()
		}
	}
	b.busy = true
	b.mu.Unlock()
	b.alone(ctx, c)
	b.next()
	return c.resp, c.err
}

// alone commits one claim as its own transaction, else branch included.
func (b *Batcher) alone(ctx context.Context, c *queued) {
	c.resp, c.err = b.cli.Txn(ctx).If(c.cmps...).Then(c.puts...).Else(c.gets...).Commit()
}

// next runs the queued claims in the background, or marks the batcher idle.
func (b *Batcher) next() {
	b.mu.Lock()
	if len(b.queue) == 0 {
		b.busy = false
		b.mu.Unlock()
		return
	}
	batch := b.take()
	b.mu.Unlock()
	go func() {
		b.run(batch)
		b.next()
	}()
}

// take removes from the queue, in order, the claims that fit one transaction: within etcd's
// operation limit and no key put twice. The first always fits (it fits alone). The caller
// holds mu.
func (b *Batcher) take() []*queued {
	var batch, rest []*queued
	ncmp, nput := 0, 0
	seen := map[string]bool{}
	for _, c := range b.queue {
		fits := len(batch) == 0 || ncmp+len(c.cmps) <= keyspace.MaxTxnOps && nput+len(c.puts) <= keyspace.MaxTxnOps
		for _, k := range c.keys {
			fits = fits && !seen[k]
		}
		if !fits {
			rest = append(rest, c)
			continue
		}
		batch = append(batch, c)
		ncmp, nput = ncmp+len(c.cmps), nput+len(c.puts)
		for _, k := range c.keys {
			seen[k] = true
		}
	}
	b.queue = rest
	return batch
}

// run commits a batch and answers each of its claims.
func (b *Batcher) run(batch []*queued) {
	defer func() {
		for _, c := range batch {
			close(c.done)
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), b.cfg.Timeout)
	defer cancel()
	if len(batch) == 1 {
		b.alone(ctx, batch[0])
		return
	}
	var cmps []clientv3.Cmp
	var puts []clientv3.Op
	for _, c := range batch {
		cmps, puts = append(cmps, c.cmps...), append(puts, c.puts...)
	}
	resp, err := b.cli.Txn(ctx).If(cmps...).Then(puts...).Commit()
	switch {
	case err != nil && !Refused(err):
		b.batched("lost", len(batch))
		for _, c := range batch {
			c.err = err
		}
	case err == nil && resp.Succeeded:
		b.batched("committed", len(batch))
		for _, c := range batch {
			c.resp = &clientv3.TxnResponse{Header: resp.Header, Succeeded: true}
		}
	default:
		// Some compare failed, or etcd refused the batch outright and applied nothing (a
		// --max-txn-ops below the default, or one claim's lease gone): each claim alone, so
		// that each learns its own outcome.
		b.batched("split", len(batch))
		var wg sync.WaitGroup
		for _, c := range batch {
			wg.Go(func() {
				b.alone(ctx, c)
			})
		}
		wg.Wait()
	}
}

// batched tells OnBatch what came of a batch of n claims.
func (b *Batcher) batched(result string, n int) {
	if b.cfg.OnBatch != nil {
		b.cfg.OnBatch(result, n)
	}
}
