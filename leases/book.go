package leases

import "github.com/leasehold/leasehold/leases/podbook"

// The pod book's types (leases/podbook), as the agent's code names them.
type (
	attachment  = podbook.Attachment
	podState    = podbook.PodState
	conflictRef = podbook.ConflictRef
	auditPod    = podbook.AuditPod
)

// ErrJournalUnwritable is wrapped by Ready's error while the local journal cannot be written
// (a full or failing --state-dir disk). ADDs still succeed (DELs wait); the pods they add are
// journaled once a retry succeeds.
var ErrJournalUnwritable = podbook.ErrJournalUnwritable
