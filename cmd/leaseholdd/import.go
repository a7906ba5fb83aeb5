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
}

func (o *importOptions) register(fs *flag.FlagSet) {
	o.hostLocal.defaultPath = func(network string) string { return filepath.Join(adopt.HostLocalDir, network) }
	fs.Var(&o.hostLocal, "import-host-local", "`NETWORK[/POOL][=DIR]`: before serving, claim the addresses host-local gave this node's "+
		"containers on NETWORK, read from DIR (default "+adopt.HostLocalDir+"/NETWORK), into POOL (default NETWORK), which must exist; repeatable")
	fs.Var(&o.whereabouts, "import-whereabouts", "`NETWORK[/POOL]=FILE`: before serving, claim the addresses of whereabouts IPPools in FILE "+
		"(kubectl get ippools.whereabouts.cni.cncf.io -A -o json) held by the pods of --import-pods; repeatable")
	fs.StringVar(&o.pods, "import-pods", "", "pods as kubectl get pods -A -o json prints them; those whose spec.nodeName is --node are this node's "+
		"(required by --import-whereabouts: an IPPool records no node)")
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

func (o *importOptions) importOne(ctx context.Context, agent *leases.Agent, s importSource, source string, recs []adopt.Record) error {
	_, err := agent.Import(ctx, leases.Import{Network: s.network, Pool: s.pool, Source: source,
		Attachments: adopt.Group(recs, o.ifName)})
	if err != nil {
		return fmt.Errorf("import %s: %w", s, err)
	}
	return nil
}
