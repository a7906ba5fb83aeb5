package leases

import (
	"errors"
	"fmt"
	"os"
	"strings"
)

// Files the default node UID is read from.
var (
	machineIDFiles = []string{"/etc/machine-id", "/var/lib/dbus/machine-id"}
	bootIDFile     = "/proc/sys/kernel/random/boot_id"
)

// DefaultNodeUID is this machine's identity for one boot: its machine ID and boot ID. A
// replacement machine under the same node name, or the same machine after a reboot (when
// every sandbox is gone), gets a different UID and so never renews the old pods' leases.
func DefaultNodeUID() (string, error) {
	var machine string
	var errs []error
	for _, f := range machineIDFiles {
		b, err := os.ReadFile(f)
		if err == nil && len(strings.TrimSpace(string(b))) > 0 {
			machine = strings.TrimSpace(string(b))
			break
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	if machine == "" {
		return "", fmt.Errorf("no machine ID (%w); set --node-uid", errors.Join(errs...))
	}
	b, err := os.ReadFile(bootIDFile)
	if err != nil {
		return "", fmt.Errorf("no boot ID (%w); set --node-uid", err)
	}
	return machine + "." + strings.TrimSpace(string(b)), nil
}

// DefaultHost names this machine and boot: its hostname and boot ID. Unlike the node UID it
// cannot be set by a flag, so two machines given one --node-uid still differ here.
func DefaultHost() string {
	name, err := os.Hostname()
	if err != nil {
		name = "unknown-host"
	}
	if b, err := os.ReadFile(bootIDFile); err == nil {
		return name + "/" + strings.TrimSpace(string(b))
	}
	return name
}
