package leases

import (
	"log/slog"
	"os"
	"slices"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// TestRenewNowRenewsEveryLeaseAndNamesTheGone: a restarted agent renews all resumed pod
// leases at once on one stream, and learns which ones etcd no longer has.
func TestRenewNowRenewsEveryLeaseAndNamesTheGone(t *testing.T) {
	cli := newClient(t)
	ctx := ctxT(t)
	k := NewKeeper(cli, 10*time.Second, 1, slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})), nil)
	defer k.Close()
	var ids []clientv3.LeaseID
	for range 300 {
		g, err := cli.Grant(ctx, 10)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, g.ID)
	}
	if _, err := cli.Revoke(ctx, ids[7]); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second) // every lease now has at most 8 s left
	gone, err := k.RenewNow(ctx, ids)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(gone, []clientv3.LeaseID{ids[7]}) {
		t.Errorf("gone: got %v, want only the revoked %v", gone, ids[7])
	}
	for i, id := range ids {
		if i == 7 {
			continue
		}
		ttl, err := cli.TimeToLive(ctx, id)
		if err != nil || ttl.TTL < 9 {
			t.Fatalf("lease %d after RenewNow: %+v, %v (want at least 9 s left)", i, ttl, err)
		}
	}
	if gone, err := k.RenewNow(ctx, nil); gone != nil || err != nil {
		t.Errorf("nothing to renew: %v, %v", gone, err)
	}
}
