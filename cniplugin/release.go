package cniplugin

import (
	"encoding/json"
	"errors"
	"path/filepath"
	"time"

	"github.com/leasehold/leasehold/allocator"
)

// ParseReleaseConfig parses a configuration for DEL and GC. A release must work even when
// the configuration no longer validates (ranges or routes edited since the ADD, or a newer,
// stricter leasehold): otherwise the runtime could never tear the sandbox down and its
// addresses would stay held. It returns ParseConfig's result when that succeeds. When
// ParseConfig refuses the configuration's content (allocator.ErrInvalidConfig), it falls
// back to what names the keys: the network name, ipam.pool, ipam.socket and ipam.timeout
// (their defaults where unreadable), the attachment and the pod. The request's pool then
// has a name and no ranges; the agent releases by its owner index, which needs no more.
//
// Errors: undecodable JSON (ErrUndecodable), and names that cannot be key parts
// (allocator.ErrInvalidName) or bad CNI_ARGS, since without them nothing can be found.
func ParseReleaseConfig(stdin []byte, cniArgs, containerID, ifName, netns string) (*Config, error) {
	cfg, err := ParseConfig(stdin, cniArgs, containerID, ifName, netns)
	if err == nil || !errors.Is(err, allocator.ErrInvalidConfig) {
		return cfg, err
	}
	var nc rawNetConf
	if json.Unmarshal(stdin, &nc) != nil {
		return nil, err
	}
	if nerr := allocator.ValidateName("network", nc.Name); nerr != nil {
		return nil, err
	}
	// Best effort: json.Unmarshal fills the fields it can and reports the first it cannot.
	var loose struct {
		Socket  string `json:"socket"`
		Pool    string `json:"pool"`
		Timeout string `json:"timeout"`
	}
	_ = json.Unmarshal(nc.IPAM, &loose)
	ipam := IPAMConfig{Type: "leasehold", Socket: DefaultSocket, Timeout: DefaultTimeout, Pool: nc.Name}
	if filepath.IsAbs(loose.Socket) {
		ipam.Socket = loose.Socket
	}
	if d, derr := time.ParseDuration(loose.Timeout); derr == nil && d > 0 {
		ipam.Timeout = d
	}
	if loose.Pool != "" {
		if nerr := allocator.ValidateName("pool", loose.Pool); nerr != nil {
			return nil, nerr
		}
		ipam.Pool = loose.Pool
	}
	args, aerr := attachmentArgs(cniArgs, containerID, ifName)
	if aerr != nil {
		return nil, aerr
	}
	return &Config{
		CNIVersion: nc.CNIVersion,
		Name:       nc.Name,
		IPAM:       ipam,
		Request: allocator.Request{
			Network:     nc.Name,
			Pool:        allocator.PoolSpec{Name: ipam.Pool},
			ContainerID: containerID,
			IfName:      ifName,
			Netns:       netns,
			Pod:         args.Pod,
		},
		ValidAttachments: nc.ValidAttachments,
	}, nil
}
