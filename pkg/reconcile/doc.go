// Package reconcile is the runtime that runs a process's sharded reconcilers
// and singleton jobs on top of coord's leases (docs/design.md#membership to #handover).
//
// A sharded reconciler claims due keys of the work queue only in the shards
// whose leases its process holds, and runs each key in a transaction fenced
// on that shard's lease; the key is deleted at the generation it claimed, so
// an enqueue during the run makes it run again. A singleton job runs while
// its process holds singleton:<name>. A periodic singleton records the last
// period it completed inside its fenced transaction, so a takeover neither
// skips nor repeats a period. A sink saves its cursor after every delivered
// batch; a new holder resumes from it (at-least-once).
//
// Renewals run in coord.Renewer on their own timer, never inside a reconcile.
// A role with no sharded reconciler holds no shard leases. On SIGTERM the
// runtime stops claiming, lets running transactions finish, hands its claims
// back, then releases every lease and deletes its workers rows. A renewal or
// reconcile loop stalled past SelfReleaseAfter releases every lease and fails
// /livez, so the supervisor restarts the process.
package reconcile
