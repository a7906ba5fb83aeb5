// Package agentapi is the protocol between the leasehold CNI plugin and the node agent
// (leaseholdd) over a root-only unix socket: one JSON request per connection, one JSON
// response, then close. Its one operation is a whole plugin invocation, the plugin's CNI
// environment and stdin, answered with what the plugin prints and its exit status. It
// holds the agent's end, Listen and Serve, which run invocations with an Invoker (package
// cniplugin makes one from the agent's Service); and Client, NewInvocation and
// Output.Result, which send and read invocations as the plugin binary does, for tests and
// benchmarks (the binary's own client is package thin). It imports only the standard
// library, package allocator and package thin.
package agentapi
