// Command leaseholdctl is leasehold's admin tool: it reads (and, for repairs, writes)
// leasehold's keys in etcd. Its connection flags follow etcdctl's.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leasehold/leasehold/leases"
)

// Exit codes scripts can rely on.
const (
	exitOK    = 0
	exitError = 1 // the command ran and failed (etcd unreachable, bad data)
	exitUsage = 2 // the command line is wrong
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

const usage = `leaseholdctl: inspect leasehold's state in etcd

usage: leaseholdctl [flags] COMMAND

commands:
  pool list        pool definitions with their ranges and how many addresses are allocated
  alloc list       allocations (filter with --pool, --node, --owner, --namespace)

flags (etcdctl-compatible; each also read from ETCDCTL_ENDPOINTS, ETCDCTL_CACERT, ...):
`

type globals struct {
	endpoints, cacert, cert, key, user string
	output, pool, node, owner, ns      string
	cluster                            string
	timeout                            time.Duration
}

func run(args []string, stdout, stderr io.Writer) int {
	g := globals{}
	fs := flag.NewFlagSet("leaseholdctl", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, usage); fs.PrintDefaults() }
	fs.StringVar(&g.endpoints, "endpoints", env("ETCDCTL_ENDPOINTS", "http://127.0.0.1:2379"), "comma-separated etcd client URLs")
	fs.StringVar(&g.cacert, "cacert", os.Getenv("ETCDCTL_CACERT"), "CA bundle of etcd's server certificate")
	fs.StringVar(&g.cert, "cert", os.Getenv("ETCDCTL_CERT"), "client certificate")
	fs.StringVar(&g.key, "key", os.Getenv("ETCDCTL_KEY"), "client key")
	fs.StringVar(&g.user, "user", os.Getenv("ETCDCTL_USER"), "etcd user as NAME:PASSWORD")
	fs.DurationVar(&g.timeout, "command-timeout", 10*time.Second, "timeout of the whole command")
	fs.StringVar(&g.cluster, "cluster", "", "only this cluster's records (default: all clusters)")
	fs.StringVar(&g.output, "o", "table", "output format: table or json")
	fs.StringVar(&g.pool, "pool", "", "alloc list: only this pool")
	fs.StringVar(&g.node, "node", "", "alloc list: only this node")
	fs.StringVar(&g.owner, "owner", "", "alloc list: only this owner (pod UID or container ID)")
	fs.StringVar(&g.ns, "namespace", "", "alloc list: only pods of this namespace")
	words, err := parseInterspersed(fs, args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return exitUsage
	}
	cmd := strings.Join(words, " ")
	if g.output != "table" && g.output != "json" {
		fmt.Fprintf(stderr, "leaseholdctl: -o %q: want table or json\n", g.output)
		return exitUsage
	}
	var do func(context.Context, *clientv3.Client, globals, io.Writer) error
	switch cmd {
	case "pool list":
		do = poolList
	case "alloc list":
		do = allocList
	default:
		fmt.Fprintf(stderr, "leaseholdctl: unknown command %q\n\n", cmd)
		fs.Usage()
		return exitUsage
	}
	cc := leases.ClientConfig{Endpoints: strings.Split(g.endpoints, ","), CACert: g.cacert, Cert: g.cert, Key: g.key}
	if g.user != "" {
		cc.Username, cc.Password, _ = strings.Cut(g.user, ":")
	}
	cli, err := cc.Dial()
	if err != nil {
		fmt.Fprintln(stderr, "leaseholdctl:", err)
		return exitError
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), g.timeout)
	defer cancel()
	if err := do(ctx, cli, g, stdout); err != nil {
		fmt.Fprintln(stderr, "leaseholdctl:", err)
		return exitError
	}
	return exitOK
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

func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func poolList(ctx context.Context, cli *clientv3.Client, g globals, w io.Writer) error {
	pools, err := leases.ListPools(ctx, cli)
	if err != nil {
		return err
	}
	allocs, err := leases.ListAllocations(ctx, cli, "")
	if err != nil {
		return err
	}
	used := map[string]int{}
	for _, a := range allocs {
		used[a.Pool]++
	}
	if g.output == "json" {
		type row struct {
			Name      string   `json:"name"`
			Ranges    any      `json:"ranges"`
			Exclude   any      `json:"exclude,omitempty"`
			Size      []string `json:"size"`
			Allocated int      `json:"allocated"`
		}
		rows := make([]row, 0, len(pools))
		for _, p := range pools {
			r := row{Name: p.Name, Ranges: p.Ranges, Exclude: p.Exclude, Allocated: used[p.Name]}
			for _, s := range p.Size() {
				r.Size = append(r.Size, s.String())
			}
			rows = append(rows, r)
		}
		return writeJSON(w, rows)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "POOL\tRANGES\tSIZE\tALLOCATED")
	for _, p := range pools {
		var sets, sizes []string
		for i, s := range p.Ranges {
			sets = append(sets, s.String())
			sizes = append(sizes, p.SetSize(i).String())
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\n", p.Name, strings.Join(sets, " | "), strings.Join(sizes, "+"), used[p.Name])
	}
	return tw.Flush()
}

func allocList(ctx context.Context, cli *clientv3.Client, g globals, w io.Writer) error {
	all, err := leases.ListAllocations(ctx, cli, g.pool)
	if err != nil {
		return err
	}
	rows := all[:0]
	for _, a := range all {
		if (g.cluster != "" && a.Cluster != g.cluster) || (g.node != "" && a.Node != g.node) ||
			(g.owner != "" && a.Owner != g.owner) || (g.ns != "" && a.Pod.Namespace != g.ns) {
			continue
		}
		rows = append(rows, a)
	}
	if g.output == "json" {
		return writeJSON(w, rows)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "POOL\tIP\tCLUSTER\tNODE\tOWNER\tPOD\tCONTAINER\tIFNAME\tLEASE")
	for _, a := range rows {
		pod := "-"
		if a.Pod.Name != "" {
			pod = a.Pod.Namespace + "/" + a.Pod.Name
		}
		if a.Unreadable != "" {
			fmt.Fprintf(tw, "%s\t%s\t?\t?\t(unreadable: %s)\t\t\t\t%s\n", a.Pool, a.IP, a.Unreadable, a.Lease)
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", a.Pool, a.IP, a.Cluster, a.Node, a.Owner, pod,
			short(a.ContainerID), a.IfName, a.Lease)
	}
	return tw.Flush()
}

func short(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
