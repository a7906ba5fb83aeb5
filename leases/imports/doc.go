// Package imports claims, for the containers still running on the node, the addresses
// another IPAM plugin (host-local, whereabouts) gave them, and keeps the ledger of what
// imports did (docs/agent.md, "Import").
package imports
