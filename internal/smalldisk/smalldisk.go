//go:build linux

// Package smalldisk is a test's full disk: a 64 KiB tmpfs on which a writer meets a real
// ENOSPC, and gets its room back when the test frees it.
package smalldisk

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// Disk is a tmpfs mounted for one test. Dir, a directory on it, is for the code under test;
// the filler that takes the last free byte lives beside it, out of its sight.
type Disk struct {
	Dir    string
	filler string
}

// New mounts a Disk, unmounted when the test ends. Without root it skips the test.
func New(t *testing.T) *Disk {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root")
	}
	dir := t.TempDir()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size=64k,mode=0700"); err != nil {
		t.Skipf("mount a tmpfs on %s: %v", dir, err)
	}
	t.Cleanup(func() { // after the cleanups of what writes on it, registered later
		if err := syscall.Unmount(dir, syscall.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
	state := filepath.Join(dir, "state")
	if err := os.Mkdir(state, 0o700); err != nil {
		t.Fatal(err)
	}
	return &Disk{Dir: state, filler: filepath.Join(dir, "filler")}
}

// Fill takes the disk's last free byte.
func (d *Disk) Fill(t *testing.T) {
	t.Helper()
	f, err := os.OpenFile(d.filler, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 4096)
	for {
		if _, err := f.Write(buf); errors.Is(err, syscall.ENOSPC) {
			return
		} else if err != nil {
			t.Fatalf("fill the disk: %v", err)
		}
	}
}

// Free gives the room Fill took back.
func (d *Disk) Free(t *testing.T) {
	t.Helper()
	if err := os.Remove(d.filler); err != nil {
		t.Fatal(err)
	}
}
