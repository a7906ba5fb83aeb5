package thin

import (
	"context"
	"encoding/base64"
	"errors"
	"io"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// The wire protocol's pieces this package speaks; package agentapi defines the protocol
// and uses these same constants.
const (
	// ProtocolVersion is agentapi.ProtocolVersion.
	ProtocolVersion = 1
	// OpCNI is the operation that carries a whole CNI invocation.
	OpCNI = "cni"
	// MaxMessageSize is agentapi.MaxMessageSize.
	MaxMessageSize = 1 << 20
	// DefaultSocket is where leaseholdd listens unless the configuration says otherwise.
	DefaultSocket = "/run/leasehold/leaseholdd.sock"
	// DefaultTimeout bounds the conversation with the agent when ipam.timeout is unset.
	DefaultTimeout = 30 * time.Second
)

// About is printed by the plugin when run without CNI_COMMAND.
const About = "leasehold IPAM: cluster-wide addresses leased from etcd"

// SupportedVersions are the CNI specification versions the plugin speaks.
var SupportedVersions = []string{"0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"}

// CurrentVersion is the newest of SupportedVersions, the one VERSION reports.
const CurrentVersion = "1.1.0"

// Invocation is one run of the plugin as the agent receives it: the CNI_* environment
// (an empty value is an unset variable, as for the CNI library) and stdin.
type Invocation struct {
	Command       string `json:"command"`
	ContainerID   string `json:"containerID,omitempty"`
	Netns         string `json:"netns,omitempty"`
	IfName        string `json:"ifName,omitempty"`
	Args          string `json:"args,omitempty"`
	Path          string `json:"path,omitempty"`
	NetnsOverride string `json:"netnsOverride,omitempty"`
	// Socket is the socket the plugin dialed, as it read it from the configuration; the
	// agent refuses the invocation if its own reading of the configuration differs.
	Socket string `json:"socket"`
	// Stdin is the network configuration as the runtime wrote it (base64 on the wire).
	Stdin []byte `json:"stdin"`
}

// The CNI error codes this package produces itself.
const (
	codeIOFailure       = 5
	codeDecodingFailure = 6
	codeInvalidNetNS    = 8
	codeTryAgainLater   = 11
	codePluginNotAvail  = 50
)

// Main runs the plugin process and exits with its status.
func Main() {
	os.Exit(Run(os.Getenv, os.Stdin, os.Stdout, os.Stderr))
}

// Run is the plugin process: it answers VERSION and the bare invocation (no CNI_COMMAND)
// itself and forwards every other command to the agent, replaying its stdout, stderr and
// exit code. Failures to reach the agent are CNI errors printed to stdout with exit
// status 1: code 11 (50 for STATUS) when the agent is not there or does not answer in
// time, 6 for a configuration that is not JSON or an answer that makes no sense.
func Run(getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) int {
	cmd := getenv("CNI_COMMAND")
	switch cmd {
	case "":
		_, _ = io.WriteString(stderr, About+"\nCNI protocol versions supported: "+strings.Join(SupportedVersions, ", ")+"\n")
		return 0
	case "VERSION":
		_, _ = stdout.Write(versionJSON())
		return 0
	}
	conf, err := io.ReadAll(io.LimitReader(stdin, maxStdin+1))
	if err != nil {
		return fail(stdout, codeIOFailure, "error reading from stdin: "+err.Error())
	}
	if len(conf) > maxStdin {
		return fail(stdout, codeDecodingFailure, "network configuration is longer than "+strconv.Itoa(maxStdin)+" bytes")
	}
	if err := Valid(conf); err != nil {
		return fail(stdout, codeDecodingFailure, "error unmarshall network config: "+err.Error())
	}
	socket, timeout := AgentOf(conf)
	unavailable := codeTryAgainLater
	if cmd == "STATUS" {
		unavailable = codePluginNotAvail
	}

	inv := Invocation{
		Command: cmd, ContainerID: getenv("CNI_CONTAINERID"), Netns: getenv("CNI_NETNS"), IfName: getenv("CNI_IFNAME"),
		Args: getenv("CNI_ARGS"), Path: getenv("CNI_PATH"), NetnsOverride: getenv("CNI_NETNS_OVERRIDE"),
		Socket: socket, Stdin: conf,
	}
	// Exchange enforces the deadline with socket timeouts and nothing here cancels, so the
	// context carries the deadline without arming a timer.
	ctx := deadlineOnly{context.Background(), time.Now().Add(timeout)}
	answer, err := Exchange(ctx, socket, encodeRequest(&inv, timeout), MaxMessageSize)
	if err != nil {
		code := unavailable
		if errors.Is(err, ErrTooLarge) {
			code = codeDecodingFailure
		}
		return fail(stdout, code, exchangeFailure(socket, cmd, timeout, err))
	}
	out, werr := decodeAnswer(answer)
	if werr != nil {
		code, msg := werr.code, werr.msg
		switch {
		case werr.sentinel == "ErrProtocol" && strings.Contains(msg, `operation "`+OpCNI+`"`):
			code, msg = codeTryAgainLater, "leaseholdd at "+socket+" is older than this plugin and does not run CNI "+
				"invocations (operation \""+OpCNI+"\"); upgrade leaseholdd to the plugin's release: "+msg
			if cmd == "STATUS" {
				code = codePluginNotAvail
			}
		case cmd == "STATUS":
			// An agent that cannot take the request is a plugin that is not available.
			code = codePluginNotAvail
		}
		return fail(stdout, code, msg)
	}
	_, _ = stderr.Write(out.stderr)
	if out.exit == 0 && (cmd == "ADD" || cmd == "DEL") && !netnsOverridden(inv.NetnsOverride) {
		// As the CNI library's skel checks after ADD and DEL: the container's namespace
		// must not be the plugin's own. (skel prints the result before this error; a
		// runtime cannot parse the two, so only the error is printed.)
		if same, err := sameNetns(inv.Netns); err != nil {
			return fail(stdout, codeInvalidNetNS, "get plugin's netns failed")
		} else if same {
			return fail(stdout, codeInvalidNetNS, "plugin's netns and netns from CNI_NETNS should not be the same")
		}
	}
	_, _ = stdout.Write(out.stdout)
	return out.exit
}

// maxStdin is the largest configuration that still fits a request once base64 has
// grown it by a third.
const maxStdin = MaxMessageSize/4*3 - 64<<10

// AgentOf is how the plugin finds the agent: ipam.socket and ipam.timeout, read from the
// (valid) configuration as the agent reads them for DEL. A socket that is not an absolute
// path, or a timeout that is not a positive duration, counts as unset (the agent refuses
// such a configuration for ADD, CHECK and STATUS with code 7); unset ones are
// DefaultSocket and DefaultTimeout.
func AgentOf(conf []byte) (socket string, timeout time.Duration) {
	socket, timeout = DefaultSocket, DefaultTimeout
	if raw, _ := Lookup(conf, "ipam", "socket"); IsString(raw) {
		if s, err := Unquote(raw); err == nil && strings.HasPrefix(s, "/") {
			socket = s
		}
	}
	if raw, _ := Lookup(conf, "ipam", "timeout"); IsString(raw) {
		if s, err := Unquote(raw); err == nil {
			if d, err := time.ParseDuration(s); err == nil && d > 0 {
				timeout = d
			}
		}
	}
	return socket, timeout
}

func encodeRequest(inv *Invocation, timeout time.Duration) []byte {
	b := make([]byte, 0, 512+base64.StdEncoding.EncodedLen(len(inv.Stdin)))
	b = append(b, `{"version":`...)
	b = strconv.AppendInt(b, ProtocolVersion, 10)
	b = append(b, `,"op":"`+OpCNI+`","timeoutMs":`...)
	b = strconv.AppendInt(b, timeout.Milliseconds(), 10)
	b = append(b, `,"request":{"command":`...)
	b = AppendQuote(b, inv.Command)
	for _, f := range [...]struct{ key, val string }{
		{"containerID", inv.ContainerID}, {"netns", inv.Netns}, {"ifName", inv.IfName}, {"args", inv.Args},
		{"path", inv.Path}, {"netnsOverride", inv.NetnsOverride}, {"socket", inv.Socket},
	} {
		b = append(b, `,"`+f.key+`":`...)
		b = AppendQuote(b, f.val)
	}
	b = append(b, `,"stdin":"`...)
	b = base64.StdEncoding.AppendEncode(b, inv.Stdin)
	return append(b, `"}}`...)
}

// output is a decoded "cni" answer.
type output struct {
	exit           int
	stdout, stderr []byte
}

// wireError is the agent's refusal of the request itself.
type wireError struct {
	code     int
	msg      string
	sentinel string
}

// decodeAnswer reads the agent's answer: {"version":1,"cni":{"exit":N,"stdout":B64,
// "stderr":B64}} or {"version":1,"error":{"code":N,"msg":S,"sentinel":S}}.
func decodeAnswer(answer []byte) (*output, *wireError) {
	protocol := func(msg string) *wireError {
		return &wireError{code: codeDecodingFailure, msg: "agent protocol error: " + msg, sentinel: "ErrProtocol"}
	}
	if err := Valid(answer); err != nil {
		return nil, protocol("undecodable answer from leaseholdd: " + err.Error())
	}
	if raw, _ := Lookup(answer, "version"); string(raw) != strconv.Itoa(ProtocolVersion) {
		return nil, protocol("leaseholdd speaks protocol version " + string(raw) + ", this plugin " +
			strconv.Itoa(ProtocolVersion) + "; install the leasehold plugin and leaseholdd from the same release")
	}
	if raw, _ := Lookup(answer, "error"); raw != nil && string(raw) != "null" {
		e := &wireError{code: 999}
		if c, _ := Lookup(raw, "code"); c != nil {
			if n, ok := Int(c); ok {
				e.code = n
			}
		}
		e.msg = stringAt(raw, "msg")
		e.sentinel = stringAt(raw, "sentinel")
		return nil, e
	}
	raw, _ := Lookup(answer, "cni")
	if raw == nil || raw[0] != '{' {
		return nil, protocol("answer from leaseholdd has neither an error nor a CNI output")
	}
	out := &output{}
	c, _ := Lookup(raw, "exit")
	n, ok := Int(c)
	if !ok || n < 0 || n > 255 {
		return nil, protocol("answer from leaseholdd has no valid exit status: " + string(c))
	}
	out.exit = n
	var err error
	if out.stdout, err = base64.StdEncoding.DecodeString(stringAt(raw, "stdout")); err != nil {
		return nil, protocol("answer from leaseholdd has undecodable stdout: " + err.Error())
	}
	if out.stderr, err = base64.StdEncoding.DecodeString(stringAt(raw, "stderr")); err != nil {
		return nil, protocol("answer from leaseholdd has undecodable stderr: " + err.Error())
	}
	return out, nil
}

// stringAt is the string at key of the valid object raw, "" when absent or not a string.
func stringAt(raw []byte, key string) string {
	v, _ := Lookup(raw, key)
	if !IsString(v) {
		return ""
	}
	s, _ := Unquote(v)
	return s
}

// exchangeFailure says why no answer came, as agentapi.Client says it.
func exchangeFailure(socket, cmd string, timeout time.Duration, err error) string {
	var ce *CallError
	errors.As(err, &ce)
	op := strings.ToLower(cmd)
	switch {
	case ce != nil && ce.Op == "dial" && !ce.Timed:
		return "leasehold agent (leaseholdd) is not reachable at " + socket + ": " + err.Error() +
			"; is leaseholdd running on this node?"
	case ce != nil && ce.Timed:
		return "leaseholdd at " + socket + " did not answer the " + op + " request within " + timeout.String() + ": " +
			err.Error() + "; try again"
	case errors.Is(err, ErrTooLarge):
		return "agent protocol error: reading " + op + " answer from leaseholdd at " + socket + ": " + err.Error()
	case errors.Is(err, io.EOF), errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
		return "leaseholdd at " + socket + " closed the connection without answering the " + op +
			" request (did it restart?): " + err.Error() + "; try again"
	}
	return "talking to leaseholdd at " + socket + " (" + op + " request): " + err.Error()
}

// fail prints a CNI error as the CNI library prints one and returns exit status 1.
func fail(stdout io.Writer, code int, msg string) int {
	b := append([]byte("{\n    \"code\": "), strconv.Itoa(code)...)
	b = append(b, ",\n    \"msg\": "...)
	b = AppendQuote(b, msg)
	b = append(b, "\n}"...)
	_, _ = stdout.Write(b)
	return 1
}

// versionJSON is what VERSION prints, byte for byte as the CNI library's skel prints it.
func versionJSON() []byte {
	b := []byte(`{"cniVersion":"` + CurrentVersion + `","supportedVersions":[`)
	for i, v := range SupportedVersions {
		if i > 0 {
			b = append(b, ',')
		}
		b = AppendQuote(b, v)
	}
	return append(b, "]}\n"...)
}

func netnsOverridden(v string) bool { return strings.ToUpper(v) == "TRUE" || v == "1" }

// sameNetns reports whether path is the network namespace this process runs in. A path
// that cannot be opened is not (the CNI library lets DEL pass a namespace that is gone).
func sameNetns(path string) (bool, error) {
	var want, own syscall.Stat_t
	if err := syscall.Stat(path, &want); err != nil {
		return false, nil
	}
	if err := syscall.Stat("/proc/self/ns/net", &own); err != nil {
		return false, err
	}
	return want.Dev == own.Dev && want.Ino == own.Ino, nil
}

// deadlineOnly is a context that carries a deadline but is never done: Exchange enforces
// the deadline with socket timeouts.
type deadlineOnly struct {
	context.Context
	deadline time.Time
}

func (d deadlineOnly) Deadline() (time.Time, bool) { return d.deadline, true }
