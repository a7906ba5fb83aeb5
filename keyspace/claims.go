package keyspace

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/leasehold/leasehold/allocator"
)

// Sticky claims (issue 19): a named claim keeps an attachment's addresses for the next
// attachment that names it, once no live pod holds them. The addresses' own keys stay the
// authority; a claim says only who may take them next.

const claimsDir = Prefix + "claims/"

// ClaimKey is /leasehold/v1/claims/<cluster>/<pool>/<claim>: one sticky claim, on its claim
// lease (renewed by the holder's agent; while nobody holds it, it runs out after the hold).
func ClaimKey(cluster, pool, claim string) string { return claimKeyIn(claimsDir, cluster, pool, claim) }

// ClaimsPrefix is the prefix of cluster's claims; with cluster "" of every cluster's.
func ClaimsPrefix(cluster string) string { return clusterPrefixIn(claimsDir, cluster) }

// ParseClaimKey splits a claim key into its cluster, pool and claim name. Empty names pass:
// its callers validate them.
func ParseClaimKey(key string) (cluster, pool, claim string, err error) {
	return parseClaimKeyIn(claimsDir, key, false)
}

// The families keyed by claim, <dir><cluster>/<pool>/<claim>: the claims and the live
// migrations (LiveMigrationKey).

// claimKeyIn is the key of claim of pool in cluster under dir.
func claimKeyIn(dir, cluster, pool, claim string) string {
	return clusterPrefixIn(dir, cluster) + pool + "/" + claim
}

// clusterPrefixIn is the prefix of cluster's keys under dir; with cluster "" dir itself.
func clusterPrefixIn(dir, cluster string) string {
	if cluster == "" {
		return dir
	}
	return dir + cluster + "/"
}

// parseClaimKeyIn splits a key under dir into its cluster, pool and claim name; with
// nonEmpty, an empty one is refused as a part missing.
func parseClaimKeyIn(dir, key string, nonEmpty bool) (cluster, pool, claim string, err error) {
	rest, ok := strings.CutPrefix(key, dir)
	if !ok {
		return "", "", "", fmt.Errorf("key %q is not under %s", key, dir)
	}
	parts := strings.Split(rest, "/")
	if len(parts) != 3 || nonEmpty && slices.Contains(parts, "") {
		return "", "", "", fmt.Errorf("key %q: want %s<cluster>/<pool>/<claim>", key, dir)
	}
	return parts[0], parts[1], parts[2], nil
}

// ClaimRecord is the value of a claim key: the addresses (one per range set of the pool), who
// holds them now (nil: nobody; the addresses rest in quarantine under the claim until the hold
// runs out or the next holder takes them), and for how long the claim outlives a release.
type ClaimRecord struct {
	IPs    []netip.Addr `json:"ips"`
	Holder *ClaimHolder `json:"holder,omitempty"`
	// HoldSeconds is how long the claim outlives its holder's release: its lease's TTL.
	HoldSeconds int64     `json:"holdSeconds"`
	Since       time.Time `json:"since"`
	// Released is when the last holder released it (zero while held).
	Released time.Time `json:"released,omitzero"`
	// Migratable lets a second pod of the claim, on another node, hold its addresses while
	// the holder runs: a live migration's target (LiveMigrationKey; issue 35).
	Migratable bool `json:"migratable,omitempty"`
}

// ClaimHolder names the attachment holding a claim.
type ClaimHolder struct {
	Owner       string           `json:"owner"`
	Pod         allocator.PodRef `json:"pod,omitzero"`
	Node        string           `json:"node"`
	NodeUID     string           `json:"nodeUID"`
	ContainerID string           `json:"containerID"`
	IfName      string           `json:"ifName"`
	// LeaseID is the holder's pod lease, in etcdctl's hex form.
	LeaseID string `json:"leaseID"`
}
