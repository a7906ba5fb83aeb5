// Package cniplugin is the leasehold CNI IPAM plugin: it parses the network
// configuration into allocator requests, asks the node agent for addresses over the
// agentapi socket and prints the CNI result with routes and DNS. It links no etcd, gRPC
// or netlink code, so the plugin binary starts as fast as a process can.
package cniplugin
