// Package agentapi is the protocol between the leasehold CNI plugin and the node agent
// (leaseholdd) over a root-only unix socket: one JSON request per connection, one JSON
// response, then close. It holds both ends: Client for the plugin, Listen and Serve for
// the agent, which passes its own implementation of Service. It imports only the
// standard library and package allocator, so the plugin binary stays small and fast.
package agentapi
