package keeper_test

import (
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/internal/etcdtest"
	"github.com/leasehold/leasehold/leases/keeper"
)

// A Keeper holds the leases of keys that must go with their owner: a key written with a lease
// from Take lives while the keeper renews the lease (or, after Close, for one TTL), and Revoke
// deletes it at once.
func ExampleNew() {
	ctx, cli, done, err := etcdtest.Connect()
	if err != nil {
		fmt.Println(err)
		return
	}
	defer done()

	k, err := keeper.New(cli, keeper.Config{TTL: 5 * time.Second, Spares: 1})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer k.Close()
	id, err := k.Take(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	if _, err := cli.Put(ctx, "/example/keeper/held", "x", clientv3.WithLease(id)); err != nil {
		k.Return(id) // no key was written with it
		fmt.Println(err)
		return
	}
	got, err := cli.Get(ctx, "/example/keeper/held")
	fmt.Println("held:", got.Count, k.Holds(id), err)

	fmt.Println("Revoke:", k.Revoke(id))
	got, err = cli.Get(ctx, "/example/keeper/held")
	fmt.Println("after Revoke:", got.Count, k.Holds(id), err)
	// Output:
	// held: 1 true <nil>
	// Revoke: <nil>
	// after Revoke: 0 false <nil>
}
