package etcdgate

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/leasehold/leasehold/internal/etcdtest"
)

// TestHistoryStartIsBelowEveryKeyWrittenSinceARestore: after a restore, by either way etcd
// documents one, HistoryStart is at most the revision the restore left, so below every key
// written since, and at least every key of the backup's when the revision was bumped.
func TestHistoryStartIsBelowEveryKeyWrittenSinceARestore(t *testing.T) {
	for _, way := range []struct {
		name string
		bump uint64
	}{{"plain", 0}, {"bumped", 1_000_000}} {
		t.Run(way.name, func(t *testing.T) {
			member := etcdtest.StartMember(t)
			cli := etcdtest.ClientAt(t, member.ClientURL)
			ctx := etcdtest.Ctx(t)
			put := func(n int) int64 {
				var rev int64
				for i := range n {
					resp, err := cli.Put(ctx, "k", fmt.Sprint(i))
					if err != nil {
						t.Fatal(err)
					}
					rev = resp.Header.Revision
				}
				return rev
			}
			// Raft entries that write no revision, before and after the backup.
			grant := func(n int) {
				for range n {
					if _, err := cli.Grant(ctx, 60); err != nil {
						t.Fatal(err)
					}
				}
			}
			grant(5)
			backed := put(20)
			backup := filepath.Join(t.TempDir(), "backup.db")
			if err := member.Snapshot(ctx, backup); err != nil {
				t.Fatal(err)
			}
			put(30) // history the restore takes away
			if err := member.Restore(backup, way.bump); err != nil {
				t.Fatal(err)
			}
			restored := backed + int64(way.bump)
			g := New(context.Background(), cli, Config{})
			for _, written := range []int64{put(1), put(10)} {
				grant(3)
				start, err := g.HistoryStart(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if start >= written || start > restored {
					t.Errorf("HistoryStart %d, want below %d, written since the restore, and at most %d, the restored revision", start, written, restored)
				}
				if way.bump > 0 && start < backed {
					t.Errorf("HistoryStart %d below %d, the backup's last revision, though the restore bumped it by %d", start, backed, way.bump)
				}
			}
		})
	}
}
