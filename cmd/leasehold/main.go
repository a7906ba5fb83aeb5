// Command leasehold is the leasehold CNI IPAM plugin ("ipam": {"type": "leasehold"}).
// It is a thin client of the node agent, leaseholdd: it forwards its CNI environment and
// stdin over the agent's unix socket and prints what the agent answers; see package thin.
package main

import "github.com/leasehold/leasehold/cniplugin/thin"

func main() { thin.Main() }
