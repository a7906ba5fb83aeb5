// Package cniplugin is the CNI logic of the leasehold IPAM plugin: it parses the network
// configuration into allocator requests, calls the agent's Service and prints the CNI
// result with routes and DNS, in every CNI version from 0.3.0 to 1.1.0.
//
// It runs inside the agent. The plugin binary is a thin client (package thin) that
// forwards its environment and stdin over the agent socket; Invoke runs them here as the
// CNI library's skel would have run them in the plugin process, calling the agent's
// Service in-process, and Served puts Invoke on the socket, whose only operation it is
// (package agentapi). Running the logic in the agent keeps encoding/json, the CNI types
// and the net package out of a process that lives for one call, where whatever is linked
// and initialized is paid again on every call.
package cniplugin
