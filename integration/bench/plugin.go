package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// pluginBin is a CNI plugin binary run the way a container runtime runs it: a new process
// per call, the CNI_* environment, the network configuration on stdin.
type pluginBin struct {
	path    string
	cniPath string
}

func newPlugin(dir, name string) pluginBin {
	return pluginBin{path: filepath.Join(dir, name), cniPath: dir}
}

// call is one plugin invocation.
type call struct {
	command   string // ADD, DEL, VERSION
	container string
	podUID    string
	netns     string
	conf      []byte
}

// run executes the plugin once and returns its stdout and the wall time from fork to exit.
func (p pluginBin) run(ctx context.Context, c call) ([]byte, time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, p.path)
	cmd.Env = []string{
		"CNI_COMMAND=" + c.command,
		"CNI_PATH=" + p.cniPath,
	}
	if c.command != "VERSION" {
		cniArgs := "IgnoreUnknown=1;K8S_POD_NAMESPACE=bench;K8S_POD_NAME=pod-" + c.container[:12] +
			";K8S_POD_INFRA_CONTAINER_ID=" + c.container + ";K8S_POD_UID=" + c.podUID
		cmd.Env = append(cmd.Env, "CNI_CONTAINERID="+c.container, "CNI_NETNS="+c.netns, "CNI_IFNAME=eth0", "CNI_ARGS="+cniArgs)
	}
	cmd.Stdin = bytes.NewReader(c.conf)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	took := time.Since(start)
	if err != nil {
		return nil, took, fmt.Errorf("%s %s: %w: %s%s", filepath.Base(p.path), c.command, err,
			strings.TrimSpace(stdout.String()), strings.TrimSpace(stderr.String()))
	}
	return stdout.Bytes(), took, nil
}

// add runs an ADD and returns the addresses of its result.
func (p pluginBin) add(ctx context.Context, c call) ([]netip.Addr, time.Duration, error) {
	c.command = "ADD"
	out, took, err := p.run(ctx, c)
	if err != nil {
		return nil, took, err
	}
	addrs, err := resultAddrs(out)
	if err != nil {
		return nil, took, fmt.Errorf("%s ADD: %w", filepath.Base(p.path), err)
	}
	return addrs, took, nil
}

// resultAddrs reads the addresses of a CNI ADD result.
func resultAddrs(out []byte) ([]netip.Addr, error) {
	var res struct {
		IPs []struct {
			Address string `json:"address"`
		} `json:"ips"`
	}
	if err := json.Unmarshal(out, &res); err != nil {
		return nil, fmt.Errorf("undecodable result %q: %w", out, err)
	}
	var addrs []netip.Addr
	for _, ip := range res.IPs {
		pfx, err := netip.ParsePrefix(ip.Address)
		if err != nil {
			return nil, fmt.Errorf("result address %q: %w", ip.Address, err)
		}
		addrs = append(addrs, pfx.Addr())
	}
	if len(addrs) == 0 {
		return nil, fmt.Errorf("result without addresses: %s", out)
	}
	return addrs, nil
}

// leaseholdConf is a network whose IPAM is leasehold, talking to the agent at socket.
func leaseholdConf(network, socket string, subnet netip.Prefix) []byte {
	return mustJSON(map[string]any{
		"cniVersion": "1.1.0", "name": network, "type": "macvlan", "master": "eth0",
		"ipam": map[string]any{
			"type": "leasehold", "socket": socket,
			"ranges": []any{[]any{map[string]any{"subnet": subnet.String()}}},
		},
	})
}

// hostLocalConf is the same network with host-local as IPAM, its state in dataDir.
func hostLocalConf(network, dataDir string, subnet netip.Prefix) []byte {
	return mustJSON(map[string]any{
		"cniVersion": "1.1.0", "name": network, "type": "macvlan", "master": "eth0",
		"ipam": map[string]any{
			"type": "host-local", "dataDir": dataDir,
			"ranges": []any{[]any{map[string]any{"subnet": subnet.String()}}},
		},
	})
}

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}
