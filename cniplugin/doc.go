// Package cniplugin is the CNI logic of the leasehold IPAM plugin: it parses the network
// configuration into allocator requests, calls the agent's Service and prints the CNI
// result with routes and DNS, in every CNI version from 0.3.0 to 1.1.0.
//
// It runs inside the agent. The plugin binary is a thin client (package thin) that
// forwards its environment and stdin over the agent socket; Invoke runs them here as the
// CNI library's skel would have run them in the plugin process, and Served puts Invoke on
// the socket next to the agent's own five operations. Running the logic in the agent
// keeps encoding/json, the CNI types and the net package out of a process that lives for
// one call: in the bench the plugin ADD went from 6.0 to 4.6-4.7 ms.
package cniplugin
