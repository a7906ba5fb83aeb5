package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/leases"
	"github.com/leasehold/leasehold/leases/adopt"
)

// importSource is one --import-host-local or --import-whereabouts value:
// NETWORK[/POOL][=PATH]. NETWORK is the CNI network name (GC collects by it), POOL the
// leasehold pool of its configuration (default NETWORK); a host-local PATH defaults to
// host-local's own directory for the network.
type importSource struct {
	network, pool, path string
}

func (s importSource) String() string {
	net := s.network
	if s.pool != "" {
		net += "/" + s.pool
	}
	return net + "=" + s.path
}

// importSources is a repeatable import flag.
type importSources struct {
	list []importSource
	// defaultPath gives the PATH of a value without one; nil: PATH is required.
	defaultPath func(network string) string
}

func (f *importSources) String() string {
	if f == nil {
		return ""
	}
	parts := make([]string, len(f.list))
	for i, s := range f.list {
		parts[i] = s.String()
	}
	return strings.Join(parts, ",")
}

func (f *importSources) Set(v string) error {
	left, path, hasPath := strings.Cut(v, "=")
	network, pool, hasPool := strings.Cut(left, "/")
	if err := allocator.ValidateName("network", network); err != nil {
		return fmt.Errorf("%q: %w; give NETWORK[/POOL]=PATH", v, err)
	}
	if hasPool {
		if err := allocator.ValidateName("pool", pool); err != nil {
			return fmt.Errorf("%q: %w; give NETWORK[/POOL]=PATH", v, err)
		}
	}
	if !hasPath && f.defaultPath != nil {
		path = f.defaultPath(network)
	}
	if path == "" {
		return fmt.Errorf("%q names no file; give NETWORK[/POOL]=PATH", v)
	}
	f.list = append(f.list, importSource{network: network, pool: pool, path: path})
	return nil
}

// importOptions are the flags of a switch from host-local or whereabouts.
type importOptions struct {
	hostLocal, whereabouts importSources
	pods, ifName           string
	// cniCache is the CNI library's cache directory, read to tell a host-local directory
	// given by mistake from a network without containers.
	cniCache string
}

func (o *importOptions) register(fs *flag.FlagSet) {
	o.hostLocal.defaultPath = func(network string) string { return filepath.Join(adopt.HostLocalDir, network) }
	fs.Var(&o.hostLocal, "import-host-local", "`NETWORK[/POOL][=DIR]`: before serving, claim the addresses host-local gave this node's "+
		"containers on NETWORK, read from DIR (default "+adopt.HostLocalDir+"/NETWORK), into POOL (default NETWORK), which must exist; repeatable")
	fs.Var(&o.whereabouts, "import-whereabouts", "`NETWORK[/POOL]=FILE`: before serving, claim the addresses of whereabouts IPPools in FILE "+
		"(kubectl get ippools.whereabouts.cni.cncf.io -A -o json) held by the pods of --import-pods; repeatable")
	fs.StringVar(&o.pods, "import-pods", "", "pods as kubectl get pods -A -o json prints them; those whose spec.nodeName is --node are this node's "+
		"(required by --import-whereabouts: an IPPool records no node)")
	fs.StringVar(&o.cniCache, "import-cni-cache", adopt.CNICacheDir, "the CNI library's cache directory (its results/ records every ADD "+
		"a runtime made and has not deleted): an --import-host-local DIR without an address file of a network the cache has "+
		"containers of stops the agent; \"\" skips that check")
	fs.StringVar(&o.ifName, "import-ifname", adopt.DefaultIfName, "interface of imported addresses whose record names none "+
		"(files of older host-local versions, whereabouts allocations before it recorded ifname)")
}

func (o *importOptions) check() error {
	if len(o.whereabouts.list) > 0 && o.pods == "" {
		return errors.New("--import-whereabouts needs --import-pods FILE: an IPPool is shared by every node and records none, " +
			"so only the allocations of this node's pods may be imported here")
	}
	if o.pods != "" && len(o.whereabouts.list) == 0 {
		return errors.New("--import-pods is only read with --import-whereabouts")
	}
	return allocator.ValidateName("--import-ifname", o.ifName)
}

// run imports every source into agent, before the agent serves. An error stops leaseholdd:
// serving without the import could hand a running container's address to another.
func (o *importOptions) run(ctx context.Context, agent *leases.Agent, node string, log *slog.Logger) error {
	for _, s := range o.hostLocal.list {
		recs, skipped, err := adopt.HostLocal(s.path, s.network)
		if err != nil {
			return fmt.Errorf("--import-host-local %s: %w", s, err)
		}
		for _, f := range skipped {
			log.Warn("import: an entry of host-local's directory that is no address file; skipped", "path", f)
		}
		if err := o.checkCache(s, recs, log); err != nil {
			return fmt.Errorf("--import-host-local %s: %w", s, err)
		}
		if err := o.importOne(ctx, agent, s, "host-local "+s.path, recs); err != nil {
			return err
		}
	}
	if len(o.whereabouts.list) == 0 {
		return nil
	}
	data, err := os.ReadFile(o.pods)
	if err != nil {
		return fmt.Errorf("--import-pods: %w", err)
	}
	pods, nodes, err := adopt.Pods(data, o.pods, node)
	if err != nil {
		return fmt.Errorf("--import-pods: %w", err)
	}
	if len(pods) == 0 {
		log.Warn("import: no pod of --import-pods runs on this node: nothing of whereabouts will be imported; if kubelet "+
			"registered the node under another name (its FQDN), give that name as --node", "file", o.pods, "node", node,
			"nodes_in_file", nodes)
	}
	for _, s := range o.whereabouts.list {
		data, err := os.ReadFile(s.path)
		if err != nil {
			return fmt.Errorf("--import-whereabouts %s: %w", s, err)
		}
		recs, err := adopt.Whereabouts(data, s.path)
		if err != nil {
			return fmt.Errorf("--import-whereabouts %s: %w", s, err)
		}
		here, elsewhere := adopt.OnNode(recs, pods)
		for _, r := range elsewhere {
			if r.Pod.Name == "" {
				log.Warn("import: a whereabouts allocation names no pod, so its node is unknown; not imported", "where", r.Where, "ip", r.Addr)
			}
		}
		log.Info("import: whereabouts allocations of pods not on this node in --import-pods are left to their nodes", "file", s.path,
			"this_node", len(here), "other_nodes", len(elsewhere))
		if err := o.importOne(ctx, agent, s, "whereabouts "+s.path, here); err != nil {
			return err
		}
	}
	return nil
}

// checkCache compares what host-local's directory holds for a network with the attachments
// the CNI library's cache records for it. A directory without a single address file while
// the cache has containers of the network is not the one host-local writes to (its dataDir
// is set elsewhere, or a path was mistyped): importing nothing would let new pods be given
// the running containers' addresses, so it is an error naming the directory to give. A
// cached attachment missing from a directory that does hold addresses is only logged: a
// container whose ADD failed after host-local's part, or a cache file left by a crash.
func (o *importOptions) checkCache(s importSource, recs []adopt.Record, log *slog.Logger) error {
	if o.cniCache == "" {
		return nil
	}
	cached, found, err := adopt.Cached(o.cniCache, s.network)
	if err != nil {
		return fmt.Errorf("%w; give --import-cni-cache \"\" to import without this check", err)
	}
	if !found {
		log.Info("import: no CNI result cache to check host-local's directory against", "cache", o.cniCache, "network", s.network,
			"addresses", len(recs))
		return nil
	}
	have := map[string]bool{}
	for _, r := range recs {
		have[r.ContainerID] = true
	}
	var missing []string
	for _, a := range cached {
		if !have[a.ContainerID] {
			missing = append(missing, a.Where...)
		}
	}
	switch {
	case len(missing) == 0:
		return nil
	case len(recs) == 0:
		return fmt.Errorf("%s holds no address file, but the CNI result cache has %d attachments of network %s on this node (%s): "+
			"host-local writes this network's addresses elsewhere. Give the directory of its configuration: its dataDir/%s, "+
			"by default %s. If those containers are gone, delete their cache files first",
			s.path, len(missing), s.network, strings.Join(firstN(missing, 3), ", "), s.network, filepath.Join(adopt.HostLocalDir, s.network))
	default:
		log.Warn("import: the CNI result cache has attachments of the network that host-local's directory has no address for; "+
			"their containers' addresses, if any, are not imported", "dir", s.path, "cache_files", firstN(missing, 10), "count", len(missing))
		return nil
	}
}

// firstN is at most n of list, with "..." standing for the rest.
func firstN(list []string, n int) []string {
	if len(list) <= n {
		return list
	}
	return append(list[:n:n], "...")
}

func (o *importOptions) importOne(ctx context.Context, agent *leases.Agent, s importSource, source string, recs []adopt.Record) error {
	_, err := agent.Import(ctx, leases.Import{Network: s.network, Pool: s.pool, Source: source,
		Attachments: adopt.Group(recs, o.ifName)})
	if err != nil {
		return fmt.Errorf("import %s: %w", s, err)
	}
	return nil
}
