package agentapi

import (
	"bytes"
	"encoding/json"
	"fmt"

	"github.com/leasehold/leasehold/allocator"
	"github.com/leasehold/leasehold/cniplugin/thin"
)

// NewInvocation returns the Invocation the plugin binary sends when a runtime runs it with
// CNI_COMMAND=command, CNI_CONTAINERID=containerID, CNI_IFNAME=ifName,
// CNI_PATH=/opt/cni/bin and the network configuration conf on stdin. Socket is the socket
// the plugin dials for conf (ipam.socket as package thin reads it); Netns is
// /var/run/netns/<containerID> when containerID is set, a path that need not exist. Set
// Args (K8S_POD_UID=...), a real Netns or any other field as a runtime would.
//
// It is for tests and benchmarks that drive the agent with the plugin's own operation:
// send the invocation with Client.Invoke (or run it in-process with cniplugin.Invoke) and
// read the answer with Output.Result.
func NewInvocation(command string, conf []byte, containerID, ifName string) *Invocation {
	socket, _ := thin.AgentOf(conf)
	inv := &Invocation{Command: command, ContainerID: containerID, IfName: ifName, Path: "/opt/cni/bin", Socket: socket, Stdin: conf}
	if containerID != "" {
		inv.Netns = "/var/run/netns/" + containerID
	}
	return inv
}

// Result reads o as a runtime reads the plugin's output. A failed command (Exit not 0) is
// returned as an *Error with the code of the CNI error it printed and its message, the
// details after "; " as the CNI library words them; its Sentinel is empty, so errors.Is
// matches the primary sentinel of the code (ErrPoolExhausted for 102). A successful ADD
// yields the addresses and gateways of the result it printed, a command that printed
// nothing an empty Result. Output that is neither is an *Error with code 6 (ErrProtocol).
func (o *Output) Result() (allocator.Result, error) {
	if o.Exit != 0 {
		var e struct {
			Code    uint   `json:"code"`
			Msg     string `json:"msg"`
			Details string `json:"details"`
		}
		if err := json.Unmarshal(o.Stdout, &e); err != nil || e.Code == 0 {
			return allocator.Result{}, outputErr("exit status %d without a CNI error on stdout: %q", o.Exit, o.Stdout)
		}
		if e.Details != "" {
			e.Msg += "; " + e.Details
		}
		return allocator.Result{}, &Error{Code: e.Code, Msg: e.Msg}
	}
	var res allocator.Result
	if len(bytes.TrimSpace(o.Stdout)) == 0 {
		return res, nil
	}
	if err := json.Unmarshal(o.Stdout, &res); err != nil {
		return allocator.Result{}, outputErr("stdout is not a CNI result: %v: %q", err, o.Stdout)
	}
	return res, nil
}

func outputErr(format string, args ...any) *Error {
	return &Error{Code: CodeDecodingFailure, Sentinel: "ErrProtocol", Msg: "agent protocol error: " + fmt.Sprintf(format, args...)}
}
