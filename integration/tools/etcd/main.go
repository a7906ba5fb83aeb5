// Command etcd is the etcd server, built from its module at the version go.mod pins, so
// tests and benchmarks can run etcd as a separate process.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
