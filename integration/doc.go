// Package integration runs leasehold's binaries together against real components: etcd
// as a separate process (built from its module by `make tools`) or embedded, the leaseholdd
// agent, the leasehold plugin executed as the runtime executes it, and etcdctl. Nothing
// imports this package. The tests find the binaries in $LEASEHOLD_BIN (make test sets it).
package integration
