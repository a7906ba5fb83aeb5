// Command leasehold is the leasehold CNI IPAM plugin ("ipam": {"type": "leasehold"}).
// It asks the node agent, leaseholdd, for addresses over a unix socket; see package
// cniplugin.
package main

import "github.com/leasehold/leasehold/cniplugin"

func main() { cniplugin.Main() }
