package main

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"path"
	"runtime"
	"sort"
	"time"
)

// imageFile is one entry of an image's single layer: a regular file copied from Src, or a
// symbolic link to Link.
type imageFile struct {
	Src  string
	Link string
	Mode int64
}

// writeImage writes a docker-archive tar (what `docker save` writes and `ctr images import`
// reads) of a one-layer image tagged with refs, made from local files only: no base image,
// no registry. The directories of every entry are created in the layer.
func writeImage(out string, refs []string, files map[string]imageFile, config map[string]any) error {
	epoch := time.Unix(0, 0).UTC()
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	dirs := map[string]bool{}
	for _, n := range names {
		var parents []string
		for d := path.Dir(n); d != "." && d != "/" && !dirs[d]; d = path.Dir(d) {
			parents = append([]string{d}, parents...)
			dirs[d] = true
		}
		for _, d := range parents {
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: 0o755, ModTime: epoch}); err != nil {
				return err
			}
		}
		f := files[n]
		if f.Link != "" {
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: n, Linkname: f.Link, Mode: 0o777, ModTime: epoch}); err != nil {
				return err
			}
			continue
		}
		b, err := os.ReadFile(f.Src)
		if err != nil {
			return err
		}
		mode := f.Mode
		if mode == 0 {
			mode = 0o755
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: n, Mode: mode, Size: int64(len(b)), ModTime: epoch}); err != nil {
			return err
		}
		if _, err := tw.Write(b); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	layerSum := sha256.Sum256(layer.Bytes())
	layerHex := hex.EncodeToString(layerSum[:])
	cfg, err := json.Marshal(map[string]any{
		"architecture": runtime.GOARCH, "os": "linux", "created": epoch.Format(time.RFC3339),
		"config": config,
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{"sha256:" + layerHex}},
	})
	if err != nil {
		return err
	}
	cfgSum := sha256.Sum256(cfg)
	cfgName := hex.EncodeToString(cfgSum[:]) + ".json"
	layerName := layerHex + "/layer.tar"
	manifest, err := json.Marshal([]map[string]any{{"Config": cfgName, "RepoTags": refs, "Layers": []string{layerName}}})
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	ow := tar.NewWriter(&buf)
	for _, e := range []struct {
		name string
		data []byte
	}{{cfgName, cfg}, {layerName, layer.Bytes()}, {"manifest.json", manifest}} {
		if d := path.Dir(e.name); d != "." {
			if err := ow.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: 0o755, ModTime: epoch}); err != nil {
				return err
			}
		}
		if err := ow.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: e.name, Mode: 0o644, Size: int64(len(e.data)), ModTime: epoch}); err != nil {
			return err
		}
		if _, err := ow.Write(e.data); err != nil {
			return err
		}
	}
	if err := ow.Close(); err != nil {
		return err
	}
	return os.WriteFile(out, buf.Bytes(), 0o600)
}

// pauseImage is busybox-static sleeping forever: the sandbox image, and the image of the
// test Deployment's containers.
func pauseImage(out, busybox string, refs ...string) error {
	return writeImage(out, refs, map[string]imageFile{"bin/busybox": {Src: busybox}, "bin/sh": {Link: "busybox"}},
		map[string]any{"Entrypoint": []string{"/bin/busybox", "sleep", "infinity"}, "WorkingDir": "/"})
}

// leaseholdImage has the paths deploy/Dockerfile gives the real image and the DaemonSet
// relies on (the agent, the CLI, the plugin the init container copies), made from the static
// binaries of `make build`, with busybox-static for the init container's /bin/sh, cp, chmod,
// mv and rm instead of a Debian base image.
func leaseholdImage(out, bin, busybox, ref string) error {
	files := map[string]imageFile{
		"usr/local/bin/leaseholdd":    {Src: path.Join(bin, "leaseholdd")},
		"usr/local/bin/leaseholdctl":  {Src: path.Join(bin, "leaseholdctl")},
		"opt/leasehold/bin/leasehold": {Src: path.Join(bin, "leasehold")},
		"bin/busybox":                 {Src: busybox},
	}
	for _, l := range []string{"sh", "cp", "chmod", "mv", "rm", "cat", "ls", "echo"} {
		files["bin/"+l] = imageFile{Link: "busybox"}
	}
	files["tmp/.keep"] = imageFile{Src: "/dev/null", Mode: 0o644}
	return writeImage(out, []string{ref}, files, map[string]any{
		"Entrypoint": []string{"/usr/local/bin/leaseholdd"}, "User": "0:0", "WorkingDir": "/",
		"Env": []string{"PATH=/usr/local/bin:/usr/bin:/bin"},
	})
}
