package keyspace_test

import (
	"strings"
	"testing"

	"github.com/leasehold/leasehold/keyspace"
)

// The agent's selection rules are read through ReadPrefixes, never RolePrefixes: an etcd role
// built from them lets an agent follow its cluster's rules but not write them, nor read
// another cluster's.
func TestReadPrefixesGrantTheClustersSelectionRulesOnly(t *testing.T) {
	under := func(key string, prefixes []string) bool {
		for _, p := range prefixes {
			if strings.HasPrefix(key, p) {
				return true
			}
		}
		return false
	}
	rw, ro := keyspace.RolePrefixes("prod"), keyspace.ReadPrefixes("prod")
	for _, key := range []string{
		keyspace.NamespaceRuleKey("prod", "net1", "team-a"),
		keyspace.NodeRuleKey("prod", "net1", "rack1"),
	} {
		if !under(key, ro) {
			t.Errorf("ReadPrefixes(prod) = %q do not grant the cluster's rule %s", ro, key)
		}
		if under(key, rw) {
			t.Errorf("RolePrefixes(prod) grant write on the selection rule %s; agents only read rules", key)
		}
	}
	// Another cluster's rules, a cluster whose name extends this one's, every cluster's.
	for _, key := range []string{
		keyspace.NamespaceRuleKey("staging", "net1", "team-a"),
		keyspace.NamespaceRuleKey("prod-b", "net1", "team-a"),
		keyspace.SelectionPrefix("", ""),
	} {
		if under(key, ro) || under(key, rw) {
			t.Errorf("the prod role would reach %s", key)
		}
	}
	for _, p := range ro {
		if under(p, rw) {
			t.Errorf("read prefix %s is also under a readwrite prefix", p)
		}
	}
}
