// Command leaseholdd is leasehold's node agent: it holds the etcd client and the pods'
// leases, and serves the leasehold CNI plugin on a unix socket.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/leasehold/leasehold/cniplugin"
	"github.com/leasehold/leasehold/cniplugin/agentapi"
	"github.com/leasehold/leasehold/etcdserver"
	"github.com/leasehold/leasehold/keyspace"
	"github.com/leasehold/leasehold/leases"
	"github.com/leasehold/leasehold/leases/node"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	os.Exit(run(os.Args[1:], os.Stderr))
}

type options struct {
	socket, node, cluster, nodeUID         string
	endpoints, cacert, cert, key           string
	username, password                     string
	embeddedDir, embeddedURL, embeddedPeer string
	leaseTTL, quarantine, gcGrace          time.Duration
	blockIdle, claimHold, reuseDelay       time.Duration
	liveMigrationBound                     time.Duration
	stateDir                               string
	livenessInterval, livenessGrace        time.Duration
	publishHosts                           bool
	hostNetns                              string
	hostResync                             time.Duration
	metricsAddr                            string
	spare                                  int
	logLevel                               string
	showVersion                            bool
	imports                                importOptions
	nodeLabels                             labelFlag
}

// labelFlag collects --node-label KEY=VALUE, repeatable or comma-separated. An empty value
// adds none: the deployment files pass the flag from a ConfigMap key that is empty by default.
type labelFlag map[string]string

func (l *labelFlag) String() string {
	var out []string
	for k, v := range *l {
		out = append(out, k+"="+v)
	}
	slices.Sort(out)
	return strings.Join(out, ",")
}

// Set adds each KEY=VALUE of v.
func (l *labelFlag) Set(v string) error {
	if strings.TrimSpace(v) == "" {
		return nil
	}
	for item := range strings.SplitSeq(v, ",") {
		k, val, ok := strings.Cut(strings.TrimSpace(item), "=")
		if !ok || k == "" {
			return fmt.Errorf("%q: want KEY=VALUE (a label of this node, as selection rules match it)", item)
		}
		if *l == nil {
			*l = labelFlag{}
		}
		(*l)[k] = val
	}
	return nil
}

func parse(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	host, _ := os.Hostname()
	fs := flag.NewFlagSet("leaseholdd", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.socket, "socket", agentapi.DefaultSocket, "unix socket the plugin talks to (created 0600)")
	fs.StringVar(&o.node, "node", host, "node name (default: the hostname)")
	fs.StringVar(&o.cluster, "cluster", "default", "cluster ID; clusters sharing one etcd keep their owners apart by it")
	fs.StringVar(&o.nodeUID, "node-uid", "", "node identity for this boot (default: machine ID + boot ID)")
	fs.StringVar(&o.endpoints, "etcd-endpoints", "", "comma-separated etcd client URLs")
	fs.StringVar(&o.cacert, "etcd-cacert", "", "CA bundle that signs etcd's server certificate")
	fs.StringVar(&o.cert, "etcd-cert", "", "client certificate for etcd")
	fs.StringVar(&o.key, "etcd-key", "", "client key for etcd")
	fs.StringVar(&o.username, "etcd-username", "", "etcd user (password from $LEASEHOLD_ETCD_PASSWORD)")
	fs.StringVar(&o.embeddedDir, "embedded-etcd", "", "run a single-member etcd in-process with its data in `DIR` (one-machine use and demos)")
	fs.StringVar(&o.embeddedURL, "embedded-etcd-client-url", "http://127.0.0.1:2379", "loopback client URL of the embedded etcd (for etcdctl)")
	fs.StringVar(&o.embeddedPeer, "embedded-etcd-peer-url", "http://127.0.0.1:2380", "peer URL of the embedded etcd")
	fs.DurationVar(&o.leaseTTL, "lease-ttl", leases.DefaultLeaseTTL, "TTL of pod and node leases")
	fs.DurationVar(&o.quarantine, "quarantine", leases.DefaultQuarantine, "how long a released address rests before reuse (0s disables)")
	fs.DurationVar(&o.claimHold, "claim-hold", leases.DefaultClaimHold, "how long a sticky claim outlives its holder's release when the network configuration gives no stickyHold (at least --lease-ttl)")
	fs.DurationVar(&o.liveMigrationBound, "live-migration-bound", leases.DefaultLiveMigrationBound, "the age above which a live migration this node takes part in has hung: logged once and counted in leasehold_live_migrations_too_old, which the LeaseholdLiveMigrationTooOld alert reads (give leaseholdctl doctor the same)")
	fs.DurationVar(&o.reuseDelay, "reuse-delay", leases.DefaultReuseDelay, "how long the addresses and blocks of a node cut off from etcd or dead are left to it after its pods' leases expire, while the pool has other room (0s: none)")
	fs.DurationVar(&o.blockIdle, "block-idle", leases.DefaultBlockIdle, "how long a block this node claimed must stay empty before it is given back to the pool (0s: never)")
	fs.DurationVar(&o.gcGrace, "gc-grace", 10*time.Second, "attachments younger than this survive CNI GC (0s: none)")
	fs.StringVar(&o.stateDir, "state-dir", "/var/lib/leasehold", "local journal of this node's pods, for re-claim after a lease loss")
	fs.DurationVar(&o.livenessInterval, "liveness-interval", 10*time.Second, "how often to look for sandboxes whose netns is gone (0s disables)")
	fs.DurationVar(&o.livenessGrace, "liveness-grace", 30*time.Second, "a pod is never released for a missing netns this soon after an ADD")
	fs.Var(&o.nodeLabels, "node-label", "a label of this node, KEY=VALUE (repeatable or comma-separated): selection rules give a node its pools by them (leaseholdctl selection set-node --labels)")
	fs.BoolVar(&o.publishHosts, "publish-host-addresses", true, "publish this node's own addresses so that no pool hands them out")
	fs.StringVar(&o.hostNetns, "host-netns", "", "network namespace whose addresses are the node's (default: the agent's own)")
	fs.DurationVar(&o.hostResync, "host-resync", 15*time.Second, "how often host addresses are listed again besides netlink events")
	fs.StringVar(&o.metricsAddr, "metrics-addr", "127.0.0.1:9615", "address serving /metrics, /healthz and /readyz (empty disables)")
	fs.IntVar(&o.spare, "spare-leases", 8, "pre-granted leases kept ready for new pods")
	fs.StringVar(&o.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.BoolVar(&o.showVersion, "version", false, "print the version and exit")
	o.imports.register(fs)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if o.showVersion {
		return o, nil
	}
	if (o.endpoints == "") == (o.embeddedDir == "") {
		return nil, errors.New("give exactly one of --etcd-endpoints URLS or --embedded-etcd DIR")
	}
	if err := o.imports.check(); err != nil {
		return nil, err
	}
	o.password = os.Getenv("LEASEHOLD_ETCD_PASSWORD")
	return o, nil
}

func run(args []string, stderr io.Writer) int {
	o, err := parse(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "leaseholdd:", err)
		return 2
	}
	if o.showVersion {
		fmt.Fprintln(os.Stdout, "leaseholdd", version)
		return 0
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(o.logLevel)); err != nil {
		fmt.Fprintln(stderr, "leaseholdd: --log-level:", err)
		return 2
	}
	log := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: level}))
	if err := serve(o, log); err != nil {
		log.Error("leaseholdd stopped", "err", err)
		return 1
	}
	return 0
}

func serve(o *options, log *slog.Logger) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	endpoints := o.endpoints
	if o.embeddedDir != "" {
		dir, err := filepath.Abs(o.embeddedDir)
		if err != nil {
			return err
		}
		srv, err := etcdserver.Start(etcdserver.Config{Dir: dir, ClientURL: o.embeddedURL, PeerURL: o.embeddedPeer})
		if err != nil {
			return err
		}
		defer srv.Close()
		endpoints = srv.ClientURL
		log.Info("embedded etcd serving", "dir", dir, "client_url", srv.ClientURL)
	}
	uid := o.nodeUID
	if uid == "" {
		var err error
		if uid, err = node.DefaultNodeUID(); err != nil {
			return err
		}
	}
	cli, err := keyspace.ClientConfig{
		Endpoints: strings.Split(endpoints, ","), CACert: o.cacert, Cert: o.cert, Key: o.key,
		Username: o.username, Password: o.password,
	}.Dial()
	if err != nil {
		return err
	}
	defer cli.Close()
	if err := keyspace.CheckConnection(ctx, cli, 10*time.Second); err != nil {
		return err
	}

	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	agent, err := leases.Start(sctx, cli, leases.Config{
		Cluster: o.cluster, Node: o.node, NodeUID: uid, NodeLabels: o.nodeLabels, LeaseTTL: o.leaseTTL, Quarantine: disabledIfZero(o.quarantine), BlockIdle: disabledIfZero(o.blockIdle), ClaimHold: o.claimHold,
		ReuseDelay: disabledIfZero(o.reuseDelay), LiveMigrationBound: o.liveMigrationBound,
		SpareLeases: o.spare, GCGrace: disabledIfZero(o.gcGrace), Version: version, Logger: log,
		PublishHostAddrs: o.publishHosts, HostNetns: o.hostNetns, HostResync: o.hostResync,
		StateDir: o.stateDir, LivenessInterval: disabledIfZero(o.livenessInterval), LivenessGrace: o.livenessGrace,
	})
	cancel()
	if err != nil {
		return fmt.Errorf("start agent against etcd %s: %w", endpoints, err)
	}
	defer agent.Close()
	// A switch from host-local or whereabouts: the running containers' addresses are claimed
	// before the socket is served, so that no ADD is given one of them.
	if err := o.imports.run(ctx, agent, o.node, log); err != nil {
		return err
	}

	if o.metricsAddr != "" {
		stopHTTP, err := serveHTTP(ctx, o.metricsAddr, agent, log)
		if err != nil {
			return err
		}
		defer stopHTTP()
	}
	log.Info("serving the CNI plugin", "socket", o.socket, "cluster", o.cluster, "node", o.node, "node_uid", uid,
		"lease_ttl", o.leaseTTL, "quarantine", o.quarantine)
	// An agent that stops itself (another host took its node identity) ends the process with
	// its reason, so that the supervisor shows it.
	sctx, stopServing := context.WithCancel(ctx)
	defer stopServing()
	go func() {
		select {
		case <-agent.Stopped():
			stopServing()
		case <-sctx.Done():
		}
	}()
	if err := serveSocket(sctx, o.socket, agent, log); err != nil {
		return err
	}
	return agent.Err()
}

// socketCheckEvery is how often the agent makes sure its socket file is still its own.
const socketCheckEvery = 2 * time.Second

// serveSocket serves the plugin on path until ctx ends. If the socket file is removed or
// replaced (a cleanup script, an rm of /run), the agent listens again, so runtimes never
// face an agent that runs but cannot be reached.
func serveSocket(ctx context.Context, path string, agent *leases.Agent, log *slog.Logger) error {
	for {
		l, err := agentapi.Listen(path)
		if err != nil {
			return err
		}
		ino := inode(path)
		sctx, stop := context.WithCancel(ctx)
		served := make(chan error, 1)
		go func() { served <- agentapi.Serve(sctx, l, cniplugin.Served(agent), log) }()
		t := time.NewTicker(socketCheckEvery)
	watch:
		for {
			select {
			case err := <-served:
				t.Stop()
				stop()
				return err
			case <-t.C:
				if ino == 0 || inode(path) != ino {
					log.Warn("the plugin socket was removed or replaced; listening again", "socket", path)
					break watch
				}
			}
		}
		t.Stop()
		stop()
		if err := <-served; err != nil && ctx.Err() == nil {
			log.Warn("serving the old socket ended", "err", err)
		}
		if ctx.Err() != nil {
			return nil
		}
	}
}

// inode is the inode number of path, or 0 when it cannot be read.
func inode(path string) uint64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Ino
	}
	return 0
}

// disabledIfZero maps a flag where 0 disables onto the agent's setting, where 0 means the
// default and a negative value disables.
func disabledIfZero(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}
