package integration

import (
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

// deployDockerfile is the parts of deploy/Dockerfile the checks read.
type deployDockerfile struct {
	froms  []string // image of each FROM
	copies []string // destinations of COPY --from=...
	runs   []string
	envs   []string
	users  []string // USER of the final stage
}

func deployParseDockerfile(text string) deployDockerfile {
	var df deployDockerfile
	joined := strings.ReplaceAll(text, "\\\n", " ")
	for _, line := range strings.Split(joined, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		switch strings.ToUpper(fields[0]) {
		case "FROM":
			for _, f := range fields[1:] {
				if !strings.HasPrefix(f, "--") {
					df.froms = append(df.froms, f)
					break
				}
			}
			df.users = nil
		case "COPY":
			if strings.Contains(line, "--from=") {
				df.copies = append(df.copies, fields[len(fields)-1])
			}
		case "RUN":
			df.runs = append(df.runs, line)
		case "ENV":
			df.envs = append(df.envs, line)
		case "USER":
			df.users = append(df.users, fields[1])
		}
	}
	return df
}

// deployCheckDockerfile: a golang builder of the go.mod's Go version running make build
// without cgo, a final image that is not the Go toolchain, running as root, and holding
// every path the DaemonSet executes or copies.
func deployCheckDockerfile(text, goVersion string, needPaths []string) []string {
	var probs []string
	df := deployParseDockerfile(text)
	if len(df.froms) < 2 {
		return append(probs, fmt.Sprintf("Dockerfile: want a multi-stage build, found FROM %v", df.froms))
	}
	if want := "golang:" + goVersion; df.froms[0] != want && !strings.HasPrefix(df.froms[0], want+"-") && !strings.HasPrefix(df.froms[0], want+".") {
		probs = append(probs, fmt.Sprintf("Dockerfile: builder is FROM %s, want %s (go.mod says go %s)", df.froms[0], want, goVersion))
	}
	if strings.HasPrefix(df.froms[len(df.froms)-1], "golang") {
		probs = append(probs, "Dockerfile: the final image is the Go toolchain image")
	}
	if !slices.ContainsFunc(df.runs, func(r string) bool { return strings.Contains(r, "make build") }) {
		probs = append(probs, "Dockerfile: no RUN runs `make build`")
	}
	if !slices.ContainsFunc(append(slices.Clone(df.envs), df.runs...), func(r string) bool { return strings.Contains(r, "CGO_ENABLED=0") }) {
		probs = append(probs, "Dockerfile: CGO_ENABLED=0 is not set for the build")
	}
	for _, u := range df.users {
		if u != "0" && u != "root" && !strings.HasPrefix(u, "0:") && !strings.HasPrefix(u, "root:") {
			probs = append(probs, fmt.Sprintf("Dockerfile: the final image runs as USER %s; leaseholdd needs root", u))
		}
	}
	for _, p := range needPaths {
		if !slices.Contains(df.copies, p) {
			probs = append(probs, fmt.Sprintf("Dockerfile: the image has no %s (COPY --from=... destinations: %v)", p, df.copies))
		}
	}
	return probs
}

// deployCheckInstall runs the init container's command the way the container would, with
// its environment (plain values) and SRC and DEST_DIR pointed into a temporary directory,
// over an existing plugin: the new plugin must end up in place, executable, as a new file (a
// rename: an in-place copy keeps the inode, and the runtime could execute a half-written
// binary), with nothing left over. With confFiles (file name -> content, as the ConfigMap at
// CONF_SRC holds them), CONF_SRC and CONF_DIR are pointed there too, over an old version of
// the first file, and each file must be installed the same way with exactly that content.
func deployCheckInstall(t *testing.T, c *corev1.Container, env deployEnv, confFiles map[string]string) []string {
	t.Helper()
	var probs []string
	if len(c.Command) < 3 || path.Base(c.Command[0]) != "sh" || c.Command[1] != "-c" {
		return append(probs, fmt.Sprintf("init container %s: command %q is not [/bin/sh -c SCRIPT]", c.Name, c.Command))
	}
	dir := t.TempDir()
	src, dest := filepath.Join(dir, "src-leasehold"), filepath.Join(dir, "dest")
	confSrc, confDir := filepath.Join(dir, "conf-src"), filepath.Join(dir, "conf")
	if err := os.WriteFile(src, []byte("new plugin"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{dest, confSrc, confDir} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	old := filepath.Join(dest, "leasehold")
	if err := os.WriteFile(old, []byte("old plugin, a bit longer"), 0o755); err != nil {
		t.Fatal(err)
	}
	names := slices.Sorted(maps.Keys(confFiles))
	for _, name := range names {
		if err := os.WriteFile(filepath.Join(confSrc, name), []byte(confFiles[name]), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// The old files, whose inodes must not be reused.
	olds := map[string]uint64{old: deployInode(t, old)}
	if len(names) > 0 {
		p := filepath.Join(confDir, names[0])
		if err := os.WriteFile(p, []byte(`{"old": "configuration, a bit longer than the new one could be"}`), 0o644); err != nil {
			t.Fatal(err)
		}
		olds[p] = deployInode(t, p)
	}
	cmd := exec.Command(c.Command[0], c.Command[1:]...)
	cmd.Args = append(cmd.Args, c.Args...)
	cmd.Env = os.Environ()
	for name, v := range env.vals {
		if env.source[name] == "value" {
			cmd.Env = append(cmd.Env, name+"="+v)
		}
	}
	cmd.Env = append(cmd.Env, "SRC="+src, "DEST_DIR="+dest)
	if confFiles != nil {
		cmd.Env = append(cmd.Env, "CONF_SRC="+confSrc, "CONF_DIR="+confDir)
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		return append(probs, fmt.Sprintf("init container %s: the install script failed: %v\n%s", c.Name, err, out))
	}
	newInfo, err := os.Stat(old)
	if err != nil {
		return append(probs, fmt.Sprintf("init container %s: no plugin at DEST_DIR/leasehold after the install: %v", c.Name, err))
	}
	if b, _ := os.ReadFile(old); string(b) != "new plugin" {
		probs = append(probs, fmt.Sprintf("init container %s: DEST_DIR/leasehold holds %q, want the new plugin", c.Name, b))
	}
	if newInfo.Mode().Perm()&0o111 != 0o111 {
		probs = append(probs, fmt.Sprintf("init container %s: the installed plugin has mode %v, not executable by all", c.Name, newInfo.Mode()))
	}
	for _, name := range names {
		p := filepath.Join(confDir, name)
		info, err := os.Stat(p)
		if err != nil {
			probs = append(probs, fmt.Sprintf("init container %s: no CNI configuration file CONF_DIR/%s after the install: %v", c.Name, name, err))
			continue
		}
		if b, _ := os.ReadFile(p); string(b) != confFiles[name] {
			probs = append(probs, fmt.Sprintf("init container %s: CONF_DIR/%s holds %q, want %q", c.Name, name, b, confFiles[name]))
		}
		if info.Mode().Perm()&0o444 != 0o444 {
			probs = append(probs, fmt.Sprintf("init container %s: CONF_DIR/%s has mode %v, not readable by all", c.Name, name, info.Mode()))
		}
	}
	for p, ino := range olds {
		if _, err := os.Stat(p); err == nil && deployInode(t, p) == ino {
			probs = append(probs, fmt.Sprintf("init container %s: %s was overwritten in place (same inode): copy to a temporary name in the same directory and rename it", c.Name, filepath.Base(p)))
		}
	}
	for d, want := range map[string][]string{dest: {"leasehold"}, confDir: names} {
		var got []string
		entries, _ := os.ReadDir(d)
		for _, e := range entries {
			got = append(got, e.Name())
		}
		if !slices.Equal(got, want) {
			probs = append(probs, fmt.Sprintf("init container %s: %s holds %v after the install, want only %s", c.Name, map[string]string{dest: "DEST_DIR", confDir: "CONF_DIR"}[d], got, strings.Join(want, " ")))
		}
	}
	return probs
}

func deployInode(t *testing.T, p string) uint64 {
	t.Helper()
	info, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	return info.Sys().(*syscall.Stat_t).Ino
}

func deployGoVersion(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindSubmatch(b)
	if m == nil {
		t.Fatal("go.mod has no go directive")
	}
	return string(m[1])
}

func deployReadFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
