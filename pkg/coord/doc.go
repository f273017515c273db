// Package coord is leasehold's coordination layer: leases held as rows of the
// leases table, the fence every dependent write opens with, and the renewal
// loop, membership and shards built on them.
//
// # Leases
//
// A lease is a row (name, owner, epoch, expires_at). Acquire and renew are the
// same guarded UPDATE over many names at once: a row changes owner only when
// it is expired, and its epoch rises on every change of owner, never on a
// renewal. Every comparison uses compute_now(), the database's clock.
//
//	           acquire (expired)              renew (owner = me)
//	unowned ───────────────────▶ held(me, e+1) ─────────────┐
//	   ▲                           │    ▲                    │
//	   │ release (owner = me)      │    └────────────────────┘
//	   └───────────────────────────┤
//	                               │ expires_at passes, another acquires
//	                               ▼
//	                        held(other, e+2)   (my fenced writes now fail)
//
// # Fencing
//
// Holding a lease is not enough: a process can pause past its TTL. Every
// write transaction on behalf of a lease starts with Fence, a SELECT … FOR
// KEY SHARE of the lease row at the held owner and epoch (both key columns:
// docs/decisions.md). No row: ErrLeaseLost and nothing commits. A row: the
// key-share lock makes a takeover's UPDATE (which changes owner and epoch)
// wait until the transaction ends, so the old holder finishes before the new
// one starts, or never starts. Row locks live in the transaction, so this is safe behind
// PgBouncer in transaction mode, unlike advisory locks.
//
// A process trusts a lease only until ValidUntil: the time the acquiring
// statement was sent plus the TTL, on the process's own clock. RunFenced
// bounds the transaction by that instant as well as by a statement timeout.
//
// # One owner of the leases table
//
// Every statement that writes or locks the leases table is in this package,
// and there is one fence strength, FOR KEY SHARE: Fence and RunFenced, and
// FenceSiteBootSQL, with which the gateway vouches for a site agent's
// discovery report by the agent's boot lease. The other row lock is
// LockForHandover's FOR UPDATE, taken by a caller that moves a lease on an
// owner's behalf (the site boot reconciler) before it calls Renew or Take:
// it waits for every open fence on the row. Ensure, Take, TakeFresh, Renew,
// AcquireMany and the release statements are the writes. Other packages
// read leases (doctor, the api's and the cli's listings, liveness joins on
// gateway:<id>) but neither write nor lock them: TestLeaseStatementsStayInCoord,
// run by make lint, fails on a statement outside this package that does.
package coord
