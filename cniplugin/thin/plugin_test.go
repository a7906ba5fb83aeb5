package thin

import (
	"bytes"
	"encoding/json"
	"io"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// rawAgent answers every connection by reading the request and then calling answer.
func rawAgent(t *testing.T, answer func(c net.Conn, req []byte)) string {
	t.Helper()
	socket := filepath.Join(t.TempDir(), "a.sock")
	l, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(2 * time.Minute)) // a bound for a client that never finishes, not a figure
				req, _ := io.ReadAll(c)
				answer(c, req)
			}()
		}
	}()
	return socket
}

// run runs the plugin for command against socket with a timeout far above what an agent
// that answers at once needs, however busy the machine.
func run(t *testing.T, command, socket string) (stdout string, stderr string, exit int, code uint) {
	t.Helper()
	return runWithin(t, command, socket, "30s")
}

// runWithin runs the plugin for command against socket with the configured timeout.
func runWithin(t *testing.T, command, socket, timeout string) (stdout string, stderr string, exit int, code uint) {
	t.Helper()
	conf := `{"cniVersion": "1.1.0", "name": "n", "ipam": {"type": "leasehold", "socket": "` + socket + `", "timeout": "` + timeout + `"}}`
	env := map[string]string{"CNI_COMMAND": command, "CNI_CONTAINERID": "c1", "CNI_IFNAME": "eth0", "CNI_PATH": "/opt/cni/bin",
		"CNI_NETNS_OVERRIDE": "1"}
	var out, errOut bytes.Buffer
	exit = Run(func(k string) string { return env[k] }, strings.NewReader(conf), &out, &errOut)
	var e struct {
		Code uint   `json:"code"`
		Msg  string `json:"msg"`
	}
	if exit != 0 {
		if err := json.Unmarshal(out.Bytes(), &e); err != nil {
			t.Fatalf("exit %d with stdout %q, not a CNI error: %v", exit, out.String(), err)
		}
	}
	return out.String(), errOut.String(), exit, e.Code
}

func TestRunReplaysTheAgentsAnswer(t *testing.T) {
	var got []byte
	socket := rawAgent(t, func(c net.Conn, req []byte) {
		got = req
		io.WriteString(c, `{"version":1,"cni":{"exit":0,"stdout":"eyJvayI6dHJ1ZX0=","stderr":"d2Fybg=="}}`)
	})
	stdout, stderr, exit, _ := run(t, "DEL", socket)
	if exit != 0 || stdout != `{"ok":true}` || stderr != "warn" {
		t.Fatalf("exit %d, stdout %q, stderr %q", exit, stdout, stderr)
	}
	// The request is the agentapi envelope around the invocation, readable by encoding/json.
	var req struct {
		Version   int        `json:"version"`
		Op        string     `json:"op"`
		TimeoutMs int64      `json:"timeoutMs"`
		Request   Invocation `json:"request"`
	}
	if err := json.Unmarshal(got, &req); err != nil {
		t.Fatalf("request %s: %v", got, err)
	}
	if req.Version != 1 || req.Op != OpCNI || req.TimeoutMs != 30000 || req.Request.Command != "DEL" ||
		req.Request.ContainerID != "c1" || req.Request.Socket != socket || !strings.Contains(string(req.Request.Stdin), `"timeout": "30s"`) {
		t.Errorf("request %+v", req)
	}
}

func TestRunFailures(t *testing.T) {
	// The slow agent closes without a word long after the plugin's 300 ms: a plugin still
	// waiting then would say so, not that the agent did not answer in time.
	const slowFor = 20 * time.Second
	slow := rawAgent(t, func(c net.Conn, _ []byte) { time.Sleep(slowFor) })
	tests := []struct {
		name   string
		answer func(c net.Conn, req []byte)
		cmd    string
		code   uint
		msg    string
	}{
		{"closed without a word", func(net.Conn, []byte) {}, "ADD", 11, "closed the connection without answering"},
		{"garbage", func(c net.Conn, _ []byte) { io.WriteString(c, "{nope") }, "ADD", 6, "undecodable answer"},
		{"other protocol version", func(c net.Conn, _ []byte) { io.WriteString(c, `{"version":2}`) }, "ADD", 6, "protocol version 2"},
		{"neither error nor output", func(c net.Conn, _ []byte) { io.WriteString(c, `{"version":1}`) }, "ADD", 6, "neither an error nor a CNI output"},
		{"bad exit", func(c net.Conn, _ []byte) { io.WriteString(c, `{"version":1,"cni":{"exit":"0"}}`) }, "ADD", 6, "no valid exit status"},
		{"bad stdout", func(c net.Conn, _ []byte) { io.WriteString(c, `{"version":1,"cni":{"exit":0,"stdout":"%%"}}`) }, "ADD", 6, "undecodable stdout"},
		{"too large", func(c net.Conn, _ []byte) { c.Write(bytes.Repeat([]byte(" "), MaxMessageSize+10)) }, "ADD", 6, "answer longer than"},
		{"refused", func(c net.Conn, _ []byte) {
			io.WriteString(c, `{"version":1,"error":{"code":11,"msg":"leaseholdd is busy","sentinel":"ErrUnavailable"}}`)
		}, "ADD", 11, "leaseholdd is busy"},
		{"refused STATUS", func(c net.Conn, _ []byte) {
			io.WriteString(c, `{"version":1,"error":{"code":11,"msg":"leaseholdd is busy","sentinel":"ErrUnavailable"}}`)
		}, "STATUS", 50, "leaseholdd is busy"},
		{"older agent", func(c net.Conn, _ []byte) {
			io.WriteString(c, `{"version":1,"error":{"code":6,"msg":"agent protocol error: unknown operation \"cni\"; leaseholdd knows add","sentinel":"ErrProtocol"}}`)
		}, "ADD", 11, "upgrade leaseholdd"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			stdout, _, exit, code := run(t, tt.cmd, rawAgent(t, tt.answer))
			if exit != 1 || code != tt.code || !strings.Contains(stdout, tt.msg) {
				t.Errorf("exit %d, code %d, stdout %s; want code %d mentioning %q", exit, code, stdout, tt.code, tt.msg)
			}
		})
	}
	t.Run("no answer in time", func(t *testing.T) {
		start := time.Now()
		stdout, _, exit, code := runWithin(t, "ADD", slow, "300ms")
		if exit != 1 || code != 11 || !strings.Contains(stdout, "did not answer the add request within 300ms") {
			t.Errorf("exit %d, code %d, stdout %s", exit, code, stdout)
		}
		if took := time.Since(start); took >= slowFor {
			t.Errorf("gave up after %s, when the agent closed; configured timeout 300ms", took)
		}
	})
	t.Run("no agent", func(t *testing.T) {
		missing := filepath.Join(t.TempDir(), "none.sock")
		for cmd, want := range map[string]uint{"ADD": 11, "STATUS": 50} {
			stdout, _, exit, code := run(t, cmd, missing)
			if exit != 1 || code != want || !strings.Contains(stdout, "not reachable at "+missing) {
				t.Errorf("%s: exit %d, code %d, stdout %s", cmd, exit, code, stdout)
			}
		}
	})
}

func TestVersionAndAbout(t *testing.T) {
	var out, errOut bytes.Buffer
	env := map[string]string{"CNI_COMMAND": "VERSION"}
	if exit := Run(func(k string) string { return env[k] }, strings.NewReader(""), &out, &errOut); exit != 0 {
		t.Fatalf("VERSION exit %d", exit)
	}
	var v struct {
		CNIVersion        string   `json:"cniVersion"`
		SupportedVersions []string `json:"supportedVersions"`
	}
	if err := json.Unmarshal(out.Bytes(), &v); err != nil || v.CNIVersion != CurrentVersion || len(v.SupportedVersions) != len(SupportedVersions) {
		t.Errorf("VERSION printed %q (%v)", out.String(), err)
	}
	out.Reset()
	if exit := Run(func(string) string { return "" }, strings.NewReader(""), &out, &errOut); exit != 0 ||
		!strings.HasPrefix(errOut.String(), About+"\n") || out.Len() != 0 {
		t.Errorf("bare run: exit %d, stdout %q, stderr %q", exit, out.String(), errOut.String())
	}
}
