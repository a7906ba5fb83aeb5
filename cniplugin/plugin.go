package cniplugin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/cniplugin/agentapi"
	"github.com/leasehold/leasehold/cniplugin/thin"
)

// About is printed by the plugin when run without CNI_COMMAND.
const About = thin.About

// SupportedVersions are the CNI specification versions the plugin speaks.
var SupportedVersions = thin.SupportedVersions

// Plugin holds the CNI command handlers, which run in the agent (see Invoke). The zero
// value is not usable: set Service, Socket and Stdout.
type Plugin struct {
	// Service is the agent the handlers call, in-process.
	Service agentapi.Service
	// Socket is the socket the plugin process dialed to reach the agent. A command whose
	// configuration names another as ipam.socket fails instead of being served by an
	// agent the configuration does not name: code 7 (50 for STATUS).
	Socket string
	// Stdout receives the result of ADD.
	Stdout io.Writer
	// Log receives diagnostics; nil discards them.
	Log *slog.Logger

	// ctx is the parent of every call's context (Background when nil): Invoke sets the
	// agent request's, so that a request that runs out of time stops its work.
	ctx context.Context
}

func (p *Plugin) base() context.Context {
	if p.ctx == nil {
		return context.Background()
	}
	return p.ctx
}

// Funcs returns p's handlers for skel.
func (p *Plugin) Funcs() skel.CNIFuncs {
	return skel.CNIFuncs{Add: p.CmdAdd, Del: p.CmdDel, Check: p.CmdCheck, GC: p.CmdGC, Status: p.CmdStatus}
}

// CmdAdd allocates the attachment's addresses from the agent and prints the result in
// the configuration's cniVersion. Errors are *types.Error: 6 for a configuration that is
// not JSON, 7 for an invalid one or one that names another socket, otherwise the agent's
// code and message (see agentapi's code table).
func (p *Plugin) CmdAdd(args *skel.CmdArgs) error {
	cfg, err := p.attachmentConfig(args)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(p.base(), cfg.IPAM.Timeout)
	defer cancel()
	svc, err := p.agent(cfg)
	if err != nil {
		return cniError(err)
	}
	alloc, err := svc.Add(ctx, cfg.Request)
	if err != nil {
		return cniError(err)
	}
	p.log().Debug("leasehold: ADD done", "network", cfg.Name, "containerID", args.ContainerID, "ips", alloc.IPs)
	if err := PrintResult(p.Stdout, NewResult(alloc, cfg.Routes, cfg.IPAM.DNS), cfg.CNIVersion); err != nil {
		return types.NewError(types.ErrIOFailure, err.Error(), "")
	}
	return nil
}

// CmdDel releases the attachment's addresses. Releasing nothing is success. Errors are
// *types.Error as for CmdAdd.
func (p *Plugin) CmdDel(args *skel.CmdArgs) error {
	cfg, err := p.releaseConfig(args)
	if err != nil {
		return err
	}
	if cfg.Request.ContainerID == "" || cfg.Request.IfName == "" {
		return types.NewError(types.ErrInvalidEnvironmentVariables, "CNI_CONTAINERID and CNI_IFNAME must both be set for DEL", "")
	}
	ctx, cancel := context.WithTimeout(p.base(), cfg.IPAM.Timeout)
	defer cancel()
	svc, err := p.agent(cfg)
	if err != nil {
		return cniError(err)
	}
	if err := svc.Del(ctx, cfg.Request); err != nil {
		return cniError(err)
	}
	return nil
}

// CmdCheck asks the agent whether the attachment still holds its addresses and, when
// the configuration carries a prevResult, compares them: every address the agent holds
// must be in prevResult, and every prevResult address inside the pool's subnets must be
// held (addresses of other subnets belong to other plugins). Errors are *types.Error:
// as for CmdAdd, 103 (no allocation) from the agent, and 103 for a mismatch, naming both
// address lists.
func (p *Plugin) CmdCheck(args *skel.CmdArgs) error {
	cfg, err := p.attachmentConfig(args)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(p.base(), cfg.IPAM.Timeout)
	defer cancel()
	svc, err := p.agent(cfg)
	if err != nil {
		return cniError(err)
	}
	held, err := svc.Check(ctx, cfg.Request)
	if err != nil {
		return cniError(err)
	}
	if cfg.PrevResult == nil {
		return nil
	}
	prev, err := resultAddrs(cfg.PrevResult)
	if err != nil {
		return types.NewError(types.ErrDecodingFailure, fmt.Sprintf("CHECK: reading prevResult: %v", err), "")
	}
	if err := compareAddrs(cfg, held, prev); err != nil {
		return cniError(err)
	}
	return nil
}

// CmdGC asks the agent to release this node's allocations of the network whose
// attachments are not in the configuration's cni.dev/valid-attachments. Errors are
// *types.Error as for CmdAdd; a configuration without that key is refused with code 7
// (see Config.GCRequest).
func (p *Plugin) CmdGC(args *skel.CmdArgs) error {
	cfg, err := p.releaseConfig(args)
	if err != nil {
		return err
	}
	req, err := cfg.GCRequest()
	if err != nil {
		return cniError(err)
	}
	ctx, cancel := context.WithTimeout(p.base(), cfg.IPAM.Timeout)
	defer cancel()
	svc, err := p.agent(cfg)
	if err != nil {
		return cniError(err)
	}
	if err := svc.GC(ctx, req); err != nil {
		return cniError(err)
	}
	return nil
}

// CmdStatus asks the agent whether an ADD could succeed now. A configuration error is
// code 6 or 7; any failure of the agent, or a configuration that names another socket,
// is code 50 (plugin not available) with the agent's message.
func (p *Plugin) CmdStatus(args *skel.CmdArgs) error {
	cfg, err := p.config(args)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(p.base(), cfg.IPAM.Timeout)
	defer cancel()
	svc, err := p.agent(cfg)
	if err == nil {
		err = svc.Status(ctx, cfg.StatusRequest())
	}
	if err != nil {
		return types.NewError(types.ErrPluginNotAvailable, err.Error(), "")
	}
	return nil
}

// config parses the configuration of args; errors are *types.Error (6 or 7).
func (p *Plugin) config(args *skel.CmdArgs) (*Config, error) {
	cfg, err := ParseConfig(args.StdinData, args.Args, args.ContainerID, args.IfName, args.Netns)
	if err != nil {
		return nil, cniError(err)
	}
	return cfg, nil
}

// releaseConfig is config for DEL and GC, which must work with a configuration that no
// longer validates (see ParseReleaseConfig).
func (p *Plugin) releaseConfig(args *skel.CmdArgs) (*Config, error) {
	cfg, err := ParseReleaseConfig(args.StdinData, args.Args, args.ContainerID, args.IfName, args.Netns)
	if err != nil {
		return nil, cniError(err)
	}
	return cfg, nil
}

// attachmentConfig is config for the commands that name one attachment (ADD, DEL, CHECK).
func (p *Plugin) attachmentConfig(args *skel.CmdArgs) (*Config, error) {
	cfg, err := p.config(args)
	if err != nil {
		return nil, err
	}
	if cfg.Request.ContainerID == "" || cfg.Request.IfName == "" {
		return nil, types.NewError(types.ErrInvalidEnvironmentVariables,
			"CNI_CONTAINERID and CNI_IFNAME must both be set for ADD, DEL and CHECK", "")
	}
	return cfg, nil
}

// agent returns the Service to serve cfg, or an error wrapping allocator.ErrInvalidConfig
// when cfg names another socket than the one the plugin dialed.
func (p *Plugin) agent(cfg *Config) (agentapi.Service, error) {
	if cfg.IPAM.Socket != p.Socket {
		return nil, fmt.Errorf("%w: the plugin reached leaseholdd at %s, but the network configuration names %s "+
			"as ipam.socket; write the key \"socket\" once, in lowercase ASCII", allocator.ErrInvalidConfig, p.Socket, cfg.IPAM.Socket)
	}
	return p.Service, nil
}

func (p *Plugin) log() *slog.Logger {
	if p.Log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return p.Log
}

// cniError turns any error into a *types.Error with the full message: an agent error
// keeps its code, an undecodable configuration is 6, and allocator sentinels follow
// agentapi's table (invalid configuration 7).
func cniError(err error) *types.Error {
	var te *types.Error
	if errors.As(err, &te) {
		return te
	}
	if errors.Is(err, ErrUndecodable) {
		return types.NewError(types.ErrDecodingFailure, err.Error(), "")
	}
	return types.NewError(agentapi.CodeOf(err), err.Error(), "")
}
