package cniplugin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"strings"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/utils"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/leasehold/leasehold/cniplugin/agentapi"
)

// Served returns what agentapi.Serve serves to the plugin binary for the agent svc: an
// Invoker that runs each plugin invocation against svc with Invoke.
func Served(svc agentapi.Service) agentapi.Invoker { return served{svc} }

type served struct{ svc agentapi.Service }

func (s served) Invoke(ctx context.Context, inv *agentapi.Invocation) *agentapi.Output {
	return Invoke(ctx, s.svc, inv)
}

// Invoke runs one plugin invocation against svc in the agent, as the plugin process ran
// it with the CNI library's skel before the binary became a thin client (package thin):
// the same checks of the environment and of the configuration's version, in the same
// order and with the same codes, then the command's handler. It returns what the process
// would print and its exit status; a failure is a CNI error on stdout with exit 1.
// Warnings go to stderr. Work stops when ctx ends.
//
// inv.Socket is the socket the plugin dialed, from its own reading of ipam.socket; if
// this reading of the configuration names another, the command fails with code 7 (50
// for STATUS) instead of being served by an agent the configuration does not name.
func Invoke(ctx context.Context, svc agentapi.Service, inv *agentapi.Invocation) *agentapi.Output {
	var stdout, stderr bytes.Buffer
	p := &Plugin{
		Service: svc,
		Socket:  inv.Socket,
		Stdout:  &stdout,
		Log:     slog.New(slog.NewTextHandler(&stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
		ctx:     ctx,
	}
	out := &agentapi.Output{}
	if err := dispatchRecovering(p, inv); err != nil {
		out.Exit, out.Err = 1, err
		data, merr := json.MarshalIndent(err, "", "    ")
		if merr != nil {
			data = []byte(`{"code": 999, "msg": "encoding the CNI error"}`)
		}
		stdout.Write(data)
	}
	out.Stdout, out.Stderr = stdout.Bytes(), stderr.Bytes()
	return out
}

// dispatchRecovering is dispatch, with a panic turned into an internal error (code 999):
// the configuration is parsed in the agent now, and a bug in that code must fail one
// command, not stop the agent that serves every pod of the node.
func dispatchRecovering(p *Plugin, inv *agentapi.Invocation) (err *types.Error) {
	defer func() {
		if r := recover(); r != nil {
			err = types.NewError(types.ErrInternal, fmt.Sprintf("leaseholdd failed running %s: %v; please report this "+
				"with the network configuration", inv.Command, r), string(debug.Stack()))
		}
	}()
	return dispatch(p, inv)
}

// envVar is one CNI_* variable: which commands need it and how it is checked.
type envVar struct {
	name     string
	val      string
	required []string
	validate func(string) *types.Error
}

// dispatch follows skel's order: required variables, then the configuration's name, then
// per command the version checks and the handler. The plugin checks after ADD and DEL that
// CNI_NETNS is not its own namespace (the agent's is not the plugin's).
func dispatch(p *Plugin, inv *agentapi.Invocation) *types.Error {
	cmd := inv.Command
	all := []string{"ADD", "CHECK", "DEL", "GC", "STATUS"}
	attachment := []string{"ADD", "CHECK", "DEL"}
	vars := []envVar{
		{"CNI_COMMAND", cmd, all, nil},
		{"CNI_CONTAINERID", inv.ContainerID, attachment, utils.ValidateContainerID},
		{"CNI_NETNS", inv.Netns, []string{"ADD", "CHECK"}, nil},
		{"CNI_IFNAME", inv.IfName, attachment, utils.ValidateInterfaceName},
		{"CNI_ARGS", inv.Args, nil, nil},
		{"CNI_PATH", inv.Path, all, nil},
		{"CNI_NETNS_OVERRIDE", inv.NetnsOverride, nil, nil},
	}
	var missing []string
	for _, v := range vars {
		needed := slices.Contains(v.required, cmd)
		switch {
		case v.val == "" && (needed || v.name == "CNI_COMMAND"):
			missing = append(missing, v.name)
		case v.val != "" && needed && v.validate != nil:
			if err := v.validate(v.val); err != nil {
				return err
			}
		}
	}
	if len(missing) > 0 {
		return types.NewError(types.ErrInvalidEnvironmentVariables,
			fmt.Sprintf("required env variables [%s] missing", strings.Join(missing, ",")), "")
	}
	info := version.PluginSupports(SupportedVersions...)
	if cmd == "VERSION" {
		var b bytes.Buffer
		if err := info.Encode(&b); err != nil {
			return types.NewError(types.ErrIOFailure, err.Error(), "")
		}
		_, _ = p.Stdout.Write(b.Bytes())
		return nil
	}
	if err := validateName(inv.Stdin); err != nil {
		return err
	}
	args := &skel.CmdArgs{ContainerID: inv.ContainerID, Netns: inv.Netns, IfName: inv.IfName, Args: inv.Args,
		Path: inv.Path, NetnsOverride: inv.NetnsOverride, StdinData: inv.Stdin}
	switch cmd {
	case "ADD":
		return call(args, info, p.CmdAdd)
	case "DEL":
		return call(args, info, p.CmdDel)
	case "CHECK":
		return callSince(args, info, "0.4.0", "CHECK", p.CmdCheck)
	case "GC":
		return callSince(args, info, "1.1.0", "GC", p.CmdGC)
	case "STATUS":
		return callSince(args, info, "1.1.0", "STATUS", p.CmdStatus)
	}
	return types.NewError(types.ErrInvalidEnvironmentVariables, fmt.Sprintf("unknown CNI_COMMAND: %v", cmd), "")
}

// validateName is skel's first look at the configuration: JSON with a valid name.
func validateName(stdin []byte) *types.Error {
	var conf struct {
		Name string `json:"name"`
	}
	if err := json.Unmarshal(stdin, &conf); err != nil {
		return types.NewError(types.ErrDecodingFailure, fmt.Sprintf("error unmarshall network config: %v", err), "")
	}
	if conf.Name == "" {
		return types.NewError(types.ErrInvalidNetworkConfig, "missing network name", "")
	}
	return utils.ValidateNetworkName(conf.Name)
}

// call checks that the configuration's cniVersion is one the plugin supports, then runs h.
func call(args *skel.CmdArgs, info version.PluginInfo, h func(*skel.CmdArgs) error) *types.Error {
	confVersion, err := (&version.ConfigDecoder{}).Decode(args.StdinData)
	if err != nil {
		return types.NewError(types.ErrDecodingFailure, err.Error(), "")
	}
	if verr := (&version.Reconciler{}).Check(confVersion, info); verr != nil {
		return types.NewError(types.ErrIncompatibleCNIVersion, "incompatible CNI versions", verr.Details())
	}
	if err := h(args); err != nil {
		var te *types.Error
		if errors.As(err, &te) {
			return te
		}
		return types.NewError(types.ErrInternal, err.Error(), "")
	}
	return nil
}

// callSince is call for a command that exists from CNI version since on: an older
// configuration, or one newer than every version the plugin supports, is code 1.
func callSince(args *skel.CmdArgs, info version.PluginInfo, since, cmd string, h func(*skel.CmdArgs) error) *types.Error {
	confVersion, err := (&version.ConfigDecoder{}).Decode(args.StdinData)
	if err != nil {
		return types.NewError(types.ErrDecodingFailure, err.Error(), "")
	}
	if ok, err := version.GreaterThanOrEqualTo(confVersion, since); err != nil {
		return types.NewError(types.ErrDecodingFailure, err.Error(), "")
	} else if !ok {
		return types.NewError(types.ErrIncompatibleCNIVersion, "config version does not allow "+cmd, "")
	}
	for _, v := range info.SupportedVersions() {
		ok, err := version.GreaterThanOrEqualTo(v, confVersion)
		if err != nil {
			return types.NewError(types.ErrDecodingFailure, err.Error(), "")
		}
		if ok {
			return call(args, info, h)
		}
	}
	return types.NewError(types.ErrIncompatibleCNIVersion, "plugin version does not allow "+cmd, "")
}
