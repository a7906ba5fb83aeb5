// Command leaseholdctl is leasehold's admin tool: it reads, checks and (for repairs) writes
// leasehold's keys in etcd. Its connection flags follow etcdctl's.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/admin"
	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/keyspace"
)

// version is set at build time (-ldflags -X main.version=...).
var version = "dev"

// Exit codes scripts can rely on; the usage text documents them.
const (
	exitOK       = 0
	exitError    = 1 // the operation failed or was refused
	exitUsage    = 2 // the command line is wrong
	exitProblems = 3 // doctor found problems
	exitNotFound = 4 // the named allocation, pool or range does not exist
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

const usage = `leaseholdctl: inspect, check and repair leasehold's state in etcd

usage: leaseholdctl [flags] COMMAND [ARGS] [flags]   (flags go before or after the command words)

pools:
  pool list                       every pool, per range set: ranges, size, allocated, quarantined, hosts, expired,
                                  free; its layout (block sizes, or flat), how many blocks nodes claim and how
                                  many of those are expired (their node's agent is gone)
  pool show NAME                  per range: subnet, start-end, gateway, counts; excludes; holders per cluster;
                                  what is held back for nodes cut off or gone (expired addresses and blocks per
                                  node, lease, when reusable) and, apart, the addresses of pods still running
                                  whose keys etcd lost (doctor's kind); layout and each block claim (block,
                                  cluster/node, agent, since, lease)
  pool show NAME --blocks         a map of the pool's blocks, one screen for a /16 of /26 blocks: per block a
                                  cell of two characters, the key of the node claiming it (upper case:
                                  expired, its agent gone) and how full it is (. none, 1-9 tenths, # full);
                                  per range set the blocks claimed, expired and free and the addresses
                                  allocated and borrowed; a legend naming each key. -o json: every block
                                  with its claim and counts, and the legend. A flat pool has no blocks (exit 1)
  pool create NAME --range SPEC [--range SPEC]... [--exclude CIDR]... [--set N] [--block-v4 N] [--block-v6 N]
                                  define a pool if absent, divided into blocks nodes claim (default /26 and
                                  /122: 64 addresses); an identical definition is a no-op (exit 0), a
                                  different one is refused showing both (exit 1)
  pool migrate NAME [--block-v4 N] [--block-v6 N] [--force]
                                  move a pool of the flat layout to blocks: freeze it (ADDs refused), move
                                  each allocation, quarantine and held key to its block keeping value and
                                  lease, unfreeze. Refused while a live agent does not serve blocks
                                  (upgrade every agent first; --force skips only this check). Idempotent; a
                                  run that stopped is resumed by running it again. Default
                                  --command-timeout 10m
  pool add-range NAME --range SPEC [--set N]
                                  add a range to a range set; every allocation is kept
  pool remove-range NAME --subnet SUBNET[,start=ADDR] [--set N]
                                  remove a range; refused while it has allocations, listing each holder
  pool close NAME, pool open NAME close a pool to new addresses (to drain it) or open it again; its
                                  allocations stay valid and renewable, and re-claims and sticky claims
                                  still get their own addresses from it. Idempotent
  pool lock NAME --namespaces NS[,NS...], pool unlock NAME
                                  only pods of these namespaces may get new addresses from the pool
selection rules (which pools a namespace's or a node's pods get addresses from, in order; per
cluster and CNI network; every agent follows a change from its next ADD):
  selection set-namespace NS --cluster C --network N --pools P[,P...]
                                  the pools of namespace NS's pods, in order; a pod may ask only for these
  selection set-node RULE --cluster C --network N --pools P[,P...] [--names PATTERN,...] [--labels K=V,...]
                  [--order N]     the pools of the nodes whose name matches a pattern and that have every
                                  label (as their agent is given with --node-label); such pools serve only
                                  nodes a rule naming them matches
  selection delete-namespace NS --cluster C --network N, selection delete-node RULE --cluster C --network N
  selection list [--cluster C] [--network N]
                                  every rule: cluster, network, kind, name, pools, match, order
  selection explain --cluster C --network N --node X [--labels K=V,...] [--namespace NS] [--ask P,...]
                  [--pool P] [--family 4,6]
                                  the pools an ADD of such a pod would try, per family, where the list
                                  comes from (the pod's request, its namespace's rule, its node's rules, the
                                  network configuration's pool --pool), and each pool passed over and why.
                                  A rule naming a pool that does not exist is refused (exit 4)
allocations:
  alloc list                      allocations; filters --pool --cluster --node --owner --namespace
  alloc show IP [--pool P]        who holds IP (in every pool holding it): its key (in either layout) and the
                                  etcdctl get of it, its block and the node claiming it, owner, pod, node,
                                  container, interface, network, lease ID and TTL left, created, held key.
                                  An address without allocation but with a held key (exit 4): expired (no key
                                  of its pod left: its node cut off or gone), the node and owner it is held
                                  back for, until when, what to do; or KEYS LOST, its pod still running (etcd
                                  lost its keys: an error), with what doctor finds of it and its fix
  alloc release IP --pool P [--force] [--quarantine 30s]
                                  release IP with its attachment's owner index and other addresses on the
                                  same lease, and their held keys, owner-compared; a lease an agent still
                                  renews needs --force
sticky claims (issue 19: an attachment naming a claim gets the addresses its previous holder had):
  claim list [--cluster C] [--pool P] [--live-migration-bound 1h]
                                  claims: cluster, pool, claim, addresses, holder (pod and node) or when it was
                                  released, hold time, claim lease TTL left, live migration (target pod and
                                  node, age, whether over the bound)
  claim show NAME [--pool P] [--cluster C] [--live-migration-bound 1h]
                                  every claim NAME (of every pool and cluster unless given): its key, holder
                                  (owner, pod, node, container, interface, pod lease) or release time, hold,
                                  lease TTL left, a live migration (target pod, node, since, age, bound), and
                                  each address: allocated (to whom), resting in quarantine under the claim, in
                                  other quarantine, or free
  claim release NAME --pool P [--cluster C] [--quarantine 30s] [--force]
                                  delete the claim (compared unchanged) and, in the same transaction, move the
                                  addresses resting under it to ordinary quarantine on a fresh lease (0s: free
                                  at once). A held claim's pod keeps its addresses; only the stickiness goes.
                                  --cluster is needed when several clusters have a claim NAME in pool P. A
                                  claim being live-migrated is refused (exit 1, naming the target) unless
                                  --force, which deletes its live migration key too, compared unchanged
nodes and problems:
  node list                       agents: identity, version, whether it serves blocks, started, lease TTL left,
                                  last renewal, pods
  node forget NODE [--cluster C]  free at once what a node that is really gone still holds back: delete the
                                  block claims and held keys naming it (each compared unchanged). Refused (exit
                                  1) while its node record exists or its pods' leases live; idempotent (a second
                                  run says nothing is held back, exit 0). --cluster is needed when keys of
                                  several clusters name NODE
  conflicts                       addresses a pod lost to another owner while its lease was lost
  pool conflicts [--pool P]       nodes whose configuration defines a pool differently from etcd
  doctor [--live-migration-bound 1h]
                                  check every invariant; print each problem with the command that fixes it
                                  (errors and warnings fail it; info findings are printed only); a live
                                  migration older than the bound is a warning
  version                         print leaseholdctl's version

SPEC, one range:  SUBNET[,start=ADDR][,end=ADDR][,gw=ADDR][,set=N]
  --range 10.10.0.0/16,start=10.10.1.0,end=10.10.9.255,gw=10.10.0.1 --range fd10::/64
  Defaults as host-local's: start = network+1, end = broadcast-1 (IPv4) or the last address, gw =
  network+1. An attachment gets one address per range set. Ranges without set= go to --set N when
  given; otherwise ranges of one family form one set, numbered in order of first appearance (the
  example above makes set 0 IPv4 and set 1 IPv6). add-range and remove-range pick the pool's only
  set of the range's family unless --set says which.
--exclude CIDR: an address or prefix never handed out; repeatable or comma-separated.
--block-v4 N, --block-v6 N: a block's prefix length per family (pool create, pool migrate). A node
  claims blocks and watches only its own; fixed once stored, since every agent must derive the same
  key for an address.
--cluster C: alloc list, claim list/show, node list, conflicts and doctor show only cluster C's
  records; pool show lists only C's holders; claim release, node forget: the claim's or node's cluster.

exit codes:
  0  ok (doctor: no problem found)
  1  the operation failed or was refused: etcd error, pool defined differently, range in use,
     live lease without --force, concurrent changes, node forget of a node with an agent
  2  usage error: unknown command or flag, flag not valid for the command, malformed argument
  3  doctor found problems (errors or warnings)
  4  not found: alloc show/release of an address without allocation (an expired one too), pool
     show/add-range/remove-range of an unknown pool or range, claim show/release of an unknown claim

flags (connection flags are etcdctl's; each defaults from ETCDCTL_<FLAG>, e.g. ETCDCTL_ENDPOINTS,
ETCDCTL_USER, ETCDCTL_COMMAND_TIMEOUT):
`

// globals are the parsed flags.
type globals struct {
	endpoints, cacert, cert, key, user, password string
	dialTimeout, timeout                         time.Duration
	output, cluster                              string
	pool, node, owner, ns                        string
	ranges, excludes                             listFlag
	set                                          int
	blockV4, blockV6                             int
	subnet                                       string
	force, blocks                                bool
	quarantine                                   time.Duration
	liveMigrationBound                           time.Duration
	// Selection rules.
	network                                         string
	pools, names, labels, ask, families, namespaces csvFlag
	order                                           int
}

// env is what a command runs with.
type env struct {
	globals
	args   []string // positional arguments after the command words
	cli    *clientv3.Client
	stdout io.Writer
	stderr io.Writer
}

type command struct {
	words []string
	args  []string // names of the positional arguments, all required
	flags []string // command flags it accepts besides the connection flags and -o
	run   func(ctx context.Context, e *env) error
	// timeout replaces --command-timeout's default when neither the flag nor
	// ETCDCTL_COMMAND_TIMEOUT gives one (pool migrate reads and writes a whole pool).
	timeout time.Duration
}

var commands = []command{
	{words: []string{"pool", "list"}, run: poolList},
	{words: []string{"pool", "show"}, args: []string{"NAME"}, flags: []string{"cluster", "blocks"}, run: poolShow},
	{words: []string{"pool", "create"}, args: []string{"NAME"}, flags: []string{"range", "exclude", "set", "block-v4", "block-v6"}, run: poolCreate},
	{words: []string{"pool", "migrate"}, args: []string{"NAME"}, flags: []string{"block-v4", "block-v6", "force"}, run: poolMigrate,
		timeout: 10 * time.Minute},
	{words: []string{"pool", "add-range"}, args: []string{"NAME"}, flags: []string{"range", "set"}, run: poolAddRange},
	{words: []string{"pool", "remove-range"}, args: []string{"NAME"}, flags: []string{"subnet", "set"}, run: poolRemoveRange},
	{words: []string{"alloc", "list"}, flags: []string{"pool", "cluster", "node", "owner", "namespace"}, run: allocList},
	{words: []string{"alloc", "show"}, args: []string{"IP"}, flags: []string{"pool"}, run: allocShow},
	{words: []string{"alloc", "release"}, args: []string{"IP"}, flags: []string{"pool", "force", "quarantine"}, run: allocRelease},
	{words: []string{"claim", "list"}, flags: []string{"cluster", "pool", "live-migration-bound"}, run: claimList},
	{words: []string{"claim", "show"}, args: []string{"NAME"}, flags: []string{"pool", "cluster", "live-migration-bound"}, run: claimShow},
	{words: []string{"claim", "release"}, args: []string{"NAME"}, flags: []string{"pool", "cluster", "quarantine", "force"}, run: claimRelease},
	{words: []string{"node", "list"}, flags: []string{"cluster"}, run: nodeList},
	{words: []string{"node", "forget"}, args: []string{"NODE"}, flags: []string{"cluster"}, run: nodeForget},
	{words: []string{"conflicts"}, flags: []string{"cluster"}, run: conflictList},
	{words: []string{"pool", "conflicts"}, flags: []string{"pool"}, run: poolConflictList},
	{words: []string{"doctor"}, flags: []string{"cluster", "live-migration-bound"}, run: doctor},
	{words: []string{"pool", "close"}, args: []string{"NAME"}, run: poolClose},
	{words: []string{"pool", "open"}, args: []string{"NAME"}, run: poolOpen},
	{words: []string{"pool", "lock"}, args: []string{"NAME"}, flags: []string{"namespaces"}, run: poolLock},
	{words: []string{"pool", "unlock"}, args: []string{"NAME"}, run: poolUnlock},
	{words: []string{"selection", "set-namespace"}, args: []string{"NAMESPACE"}, flags: []string{"cluster", "network", "pools"},
		run: selectionSetNamespace},
	{words: []string{"selection", "set-node"}, args: []string{"RULE"},
		flags: []string{"cluster", "network", "pools", "names", "labels", "order"}, run: selectionSetNode},
	{words: []string{"selection", "delete-namespace"}, args: []string{"NAMESPACE"}, flags: []string{"cluster", "network"},
		run: selectionDelete(keyspace.RuleNamespace)},
	{words: []string{"selection", "delete-node"}, args: []string{"RULE"}, flags: []string{"cluster", "network"},
		run: selectionDelete(keyspace.RuleNode)},
	{words: []string{"selection", "list"}, flags: []string{"cluster", "network"}, run: selectionList},
	{words: []string{"selection", "explain"}, flags: []string{"cluster", "network", "namespace", "node", "labels", "ask", "pool", "family"},
		run: selectionExplain},
}

// connFlags may be given with any command; each reads its default from ETCDCTL_<NAME>.
var connFlags = []string{"endpoints", "cacert", "cert", "key", "user", "password", "dial-timeout", "command-timeout"}

func newFlagSet(g *globals, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("leaseholdctl", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, usage); fs.PrintDefaults() }
	fs.StringVar(&g.endpoints, "endpoints", "http://127.0.0.1:2379", "comma-separated etcd client URLs")
	fs.StringVar(&g.cacert, "cacert", "", "CA bundle that signed etcd's server certificate")
	fs.StringVar(&g.cert, "cert", "", "client certificate (with --key)")
	fs.StringVar(&g.key, "key", "", "client key")
	fs.StringVar(&g.user, "user", "", "etcd user as NAME:PASSWORD (or NAME with --password)")
	fs.StringVar(&g.password, "password", "", "etcd password, when --user has none")
	fs.DurationVar(&g.dialTimeout, "dial-timeout", 5*time.Second, "how long to wait for the first connection")
	fs.DurationVar(&g.timeout, "command-timeout", 10*time.Second, "timeout of the whole command")
	fs.StringVar(&g.output, "o", "table", "output: table or json (also --output, -w, --write-out)")
	fs.StringVar(&g.output, "output", "table", "same as -o")
	fs.StringVar(&g.output, "w", "table", "same as -o")
	fs.StringVar(&g.output, "write-out", "table", "same as -o")
	fs.StringVar(&g.cluster, "cluster", "", "only this cluster's records (default: all clusters); claim release, node forget: the cluster")
	fs.StringVar(&g.pool, "pool", "", "alloc list/show, claim list/show: only this pool; alloc release, claim release: the pool (required); selection explain: the network configuration's pool (default: the network's name)")
	fs.StringVar(&g.node, "node", "", "alloc list: only this node; selection explain: the node the pod runs on")
	fs.StringVar(&g.owner, "owner", "", "alloc list: only this owner (pod UID or container ID)")
	fs.StringVar(&g.ns, "namespace", "", "alloc list: only pods of this namespace; selection explain: the pod's namespace")
	fs.Var(&g.ranges, "range", "pool create/add-range: a range, SUBNET[,start=A][,end=B][,gw=G][,set=N]; repeatable")
	fs.Var(&g.excludes, "exclude", "pool create: addresses or CIDRs never handed out; repeatable or comma-separated")
	fs.IntVar(&g.set, "set", -1, "pool create/add-range/remove-range: range set index; -1 picks the set by address family")
	fs.StringVar(&g.subnet, "subnet", "", "pool remove-range: the range to remove, SUBNET[,start=A]")
	fs.IntVar(&g.blockV4, "block-v4", 0, "pool create/migrate: IPv4 block prefix length, /16 to /30 (default /26)")
	fs.IntVar(&g.blockV6, "block-v6", 0, "pool create/migrate: IPv6 block prefix length, /112 to /126 (default /122)")
	fs.BoolVar(&g.force, "force", false, "alloc release: release even though the lease is alive; pool migrate: skip the agent version check; claim release: release a claim being migrated, deleting its live migration key too")
	fs.DurationVar(&g.liveMigrationBound, "live-migration-bound", admin.DefaultLiveMigrationBound, "doctor, claim list/show: the age above which a live migration has hung (doctor: live-migration-too-old)")
	fs.BoolVar(&g.blocks, "blocks", false, "pool show: draw the pool's blocks as a map, one cell per block")
	fs.DurationVar(&g.quarantine, "quarantine", 30*time.Second, "alloc release, claim release: how long released addresses rest (0s: none)")
	fs.StringVar(&g.network, "network", "", "selection: the CNI network name the rule is for")
	fs.Var(&g.pools, "pools", "selection set-namespace/set-node: the pools, in the order to try them; comma-separated or repeated")
	fs.Var(&g.names, "names", "selection set-node: node name patterns (shell patterns such as rack1-*); comma-separated or repeated")
	fs.Var(&g.labels, "labels", "selection set-node: node labels KEY=VALUE a node must all have; selection explain: the node's labels")
	fs.IntVar(&g.order, "order", 0, "selection set-node: the rule's place among the rules a node matches, lower first")
	fs.Var(&g.ask, "ask", "selection explain: the pools the pod asks for (LEASEHOLD_POOL, args.cni.pool)")
	fs.Var(&g.families, "family", "selection explain: the address families the network needs (4, 6 or 4,6), when its pool is not stored yet")
	fs.Var(&g.namespaces, "namespaces", "pool lock: the only namespaces whose pods may get new addresses from the pool")
	return fs
}

// usageError is a wrong command line: exit code 2.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return usageError{fmt.Sprintf(format, args...)} }

// errProblems is doctor's result when it found something: exit code 3.
var errProblems = errors.New("doctor found problems")

func run(args []string, stdout, stderr io.Writer) int {
	e := &env{stdout: stdout, stderr: stderr}
	fs := newFlagSet(&e.globals, stderr)
	for _, name := range connFlags {
		envName := "ETCDCTL_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
		if v := os.Getenv(envName); v != "" {
			if err := fs.Set(name, v); err != nil {
				fmt.Fprintf(stderr, "leaseholdctl: %s=%q: %v\n", envName, v, err)
				return exitUsage
			}
		}
	}
	words, err := parseInterspersed(fs, args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return exitUsage // the flag package has printed the error and the usage
	}
	if len(words) == 1 && words[0] == "version" {
		fmt.Fprintln(stdout, "leaseholdctl", version)
		return exitOK
	}
	cmd, err := pick(fs, e, words)
	if err != nil {
		fmt.Fprintf(stderr, "leaseholdctl: %v\n(leaseholdctl -h lists the commands and flags)\n", err)
		return exitUsage
	}
	if cmd.timeout > 0 && !isSet(fs, "command-timeout") {
		e.timeout = cmd.timeout
	}
	cc := keyspace.ClientConfig{Endpoints: strings.Split(e.endpoints, ","), CACert: e.cacert, Cert: e.cert, Key: e.key,
		DialTimeout: e.dialTimeout}
	if e.user != "" {
		name, pw, ok := strings.Cut(e.user, ":")
		if !ok {
			pw = e.password
		}
		cc.Username, cc.Password = name, pw
	}
	cli, err := cc.Dial()
	if err != nil {
		fmt.Fprintln(stderr, "leaseholdctl:", err)
		return exitError
	}
	defer cli.Close()
	e.cli = cli
	ctx, cancel := context.WithTimeout(context.Background(), e.timeout)
	defer cancel()
	err = cmd.run(ctx, e)
	code := exitCode(err)
	if err != nil && !errors.Is(err, errProblems) {
		fmt.Fprintln(stderr, "leaseholdctl:", err)
	}
	return code
}

// pick finds the command words name and checks its arguments and flags.
func pick(fs *flag.FlagSet, e *env, words []string) (command, error) {
	if e.output != "table" && e.output != "json" {
		return command{}, usagef("-o %q: want table or json", e.output)
	}
	if len(words) == 0 {
		return command{}, usagef("no command given")
	}
	if e.cluster != "" {
		if err := allocator.ValidateName("cluster", e.cluster); err != nil {
			return command{}, usageError{err.Error()}
		}
	}
	for _, c := range commands {
		if len(words) < len(c.words) || !slices.Equal(words[:len(c.words)], c.words) {
			continue
		}
		name := strings.Join(c.words, " ")
		e.args = words[len(c.words):]
		if len(e.args) != len(c.args) {
			return command{}, usagef("%s takes %s, got %q", name, argsText(c.args), e.args)
		}
		var bad []string
		fs.Visit(func(f *flag.Flag) {
			if !slices.Contains(connFlags, f.Name) && !slices.Contains([]string{"o", "output", "w", "write-out"}, f.Name) &&
				!slices.Contains(c.flags, f.Name) {
				bad = append(bad, "--"+f.Name)
			}
		})
		if len(bad) > 0 {
			return command{}, usagef("%s does not take %s", name, strings.Join(bad, ", "))
		}
		return c, nil
	}
	return command{}, usagef("unknown command %q", strings.Join(words, " "))
}

// isSet reports whether flag name was given, on the command line or from its ETCDCTL_ variable.
func isSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

func argsText(names []string) string {
	if len(names) == 0 {
		return "no arguments"
	}
	return "one argument, " + strings.Join(names, " ")
}

// exitCode maps a command's error to the documented exit codes.
func exitCode(err error) int {
	var ue usageError
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &ue):
		return exitUsage
	case errors.Is(err, errProblems):
		return exitProblems
	case errors.Is(err, admin.ErrNotFound):
		return exitNotFound
	}
	return exitError
}

// parseInterspersed parses flags placed anywhere, before or after the command words
// (`leaseholdctl alloc list --pool net1`), and returns the words.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var words []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		if fs.NArg() == 0 {
			return words, nil
		}
		words = append(words, fs.Arg(0))
		args = fs.Args()[1:]
	}
}
