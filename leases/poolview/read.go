package poolview

import (
	"context"
	"net/netip"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/keyspace"
)

// The reads a view makes in chunks: a listing of many blocks, the held keys of many addresses.

// blockReads are the reads that list one block this node follows: its allocation keys, its
// quarantine keys and its held keys.
func blockReads(pool string, b netip.Prefix) []clientv3.Op {
	return []clientv3.Op{
		clientv3.OpGet(keyspace.BlockIPsPrefix(pool, b), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
		clientv3.OpGet(keyspace.BlockQuarantinePrefix(pool, b), clientv3.WithPrefix()),
		clientv3.OpGet(keyspace.BlockHeldPrefix(pool, b), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
	}
}

// readChunked runs read-only ops in transactions of at most keyspace.MaxTxnOps each (etcd refuses
// larger ones: a node holding many blocks lists them in several), and returns each op's
// response with the header of the transaction that read it. A chunk holds a multiple of 3
// ops, so that one block's reads (blockReads) are read at one revision.
func ReadChunked(ctx context.Context, cli *clientv3.Client, ops []clientv3.Op) ([]*pb.ResponseOp, []*pb.ResponseHeader, error) {
	resps := make([]*pb.ResponseOp, 0, len(ops))
	hdrs := make([]*pb.ResponseHeader, 0, len(ops))
	for len(ops) > 0 {
		n := min(len(ops), keyspace.MaxTxnOps/3*3)
		resp, err := cli.Txn(ctx).Then(ops[:n]...).Commit()
		if err != nil {
			return nil, nil, err
		}
		for _, r := range resp.Responses {
			resps = append(resps, r)
			hdrs = append(hdrs, resp.Header)
		}
		ops = ops[n:]
	}
	return resps, hdrs, nil
}
