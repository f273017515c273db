// Package queue is the work queue of sharded reconcilers
// (docs/design.md#work-queue): one row per (reconciler, key) in work_queue,
// sharded by coord.ShardOf(key) onto the 256 shard leases.
//
// # Life of a key
//
//	                  Enqueue: generation+1, due_at = LEAST(due_at, new)
//	                   ┌──────┐
//	                   ▼      │
//	(none) ─Enqueue─▶ queued(g) ──Claim (shard held, due)──▶ claimed(g, owner, until)
//	  ▲                 ▲  ▲                                     │  │  │
//	  │                 │  └───── Fail: last_error, back-off ────┘  │  │
//	  │                 └──────── Complete, generation > g: Rearmed ┘  │
//	  └────────────────────────── Complete at generation g: Deleted ───┘
//
// An enqueue while claimed bumps the generation and leaves the claim alone.
// A claim whose claimed_until passes (its worker died or stalled) is
// claimable again by whoever holds the shard.
//
// # Generations: no wake-up is lost
//
// Enqueue never creates a second row: it bumps the key's generation and
// pulls due_at earlier, never later. Claim records the generation it took,
// and Complete deletes the row only at that generation. An enqueue that
// lands while the key runs (the state the run read may already be stale)
// bumps the generation, so Complete keeps the row and clears the claim
// instead: the key runs again. Both statements lock the row, so whichever
// commits second sees the other's effect; there is no window in which a
// wake-up is deleted unseen.
//
// While a key is claimed its due_at is 'infinity': the run in progress
// serves every earlier wake-up, and the first enqueue during the run sets
// the due time of the next run (a reconciler's "check again in 30 s" is kept
// as asked, not collapsed into an immediate re-run).
//
// # Two safety nets: the fence and the claim expiry
//
// A worker claims keys only in shards whose leases it holds, and runs each
// key in a transaction fenced on the shard lease (coord.RunFenced), with
// Complete inside that transaction. If the lease was lost, the fence fails,
// nothing commits, and the key keeps its row and claim. The fence alone
// stops a stale worker from writing; it does not make the key run
// elsewhere. That is the claim's job: claimed_until = compute_now() +
// claimTTL, and once it has passed, the key is claimable again by the new
// shard holder. The claim also keeps two workers from starting the same key
// at once (FOR UPDATE SKIP LOCKED, then the claim columns), and Complete and
// Fail act only on the exact claim they were given (owner and
// claimed_until), so a run that outlived its claim cannot delete or re-arm a
// key someone else is running. claimTTL must exceed the longest reconcile
// (docs/design.md#timings). On shutdown, ReleaseClaims hands claims back at
// once.
//
// # Failures and attempts
//
// attempts counts runs started since the last success: Claim adds one,
// Complete resets it, Fail keeps it and sets due_at = compute_now() +
// Backoff.Delay(attempts), exponential with full jitter. Enqueue keeps
// attempts too (it is a new wake-up, not a success), so an enqueue may pull
// a backing-off key earlier, but a repeat failure backs off further.
//
// Every time comparison is made in SQL with compute_now(), never with the
// process clock.
package queue
