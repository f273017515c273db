package reconcile

// Sharded reconcilers: each claims due keys of the shards its process holds
// and runs them one by one in a transaction fenced on the shard's lease.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/health"
	"github.com/leasehold/leasehold/pkg/queue"
)

// Func reconciles one key inside a transaction fenced on its shard's lease.
// Returning an error rolls the transaction back and retries the key later.
type Func func(ctx context.Context, tx pgx.Tx, key string) error

// Sharded is a sharded reconciler: keys of the work queue under Name, spread
// over the 256 shards of Group.
type Sharded struct {
	// Name is the work_queue.reconciler value.
	Name string
	// Group is the membership group whose shard leases fence it.
	Group coord.Group
	// Reconcile handles one key.
	Reconcile Func
	// Poll, when set, is how often this reconciler's idle loop looks for
	// due keys instead of Config.Poll: a reconciler whose keys are enqueued
	// to be picked up at once (one wave of a run after another) trades one
	// claim query per Poll for the latency.
	Poll time.Duration
}

type leaseKey struct{}

type afterCommitKey struct{}

// afterCommit collects the functions of one reconcile attempt.
type afterCommit struct{ fns []func() }

// AfterCommit registers fn to run once the sharded reconcile transaction of
// ctx has committed (never when it rolls back or is refused by the fence),
// for side effects that must not be seen before the rows they announce,
// such as a NOTIFY through pkg/cmdwake. It returns false, and does nothing,
// when ctx is not a sharded reconcile's.
func AfterCommit(ctx context.Context, fn func()) bool {
	ac, ok := ctx.Value(afterCommitKey{}).(*afterCommit)
	if ok {
		ac.fns = append(ac.fns, fn)
	}
	return ok
}

// LeaseFrom returns the shard lease a sharded reconcile runs under (its
// epoch is the fencing token to record, e.g. on an allocation).
func LeaseFrom(ctx context.Context) (coord.Lease, bool) {
	l, ok := ctx.Value(leaseKey{}).(coord.Lease)
	return l, ok
}

// RegisterSharded adds a sharded reconciler. Call before starting.
func (rt *Runtime) RegisterSharded(s Sharded) error {
	if err := queue.ValidateReconciler(s.Name); err != nil {
		return err
	}
	if s.Reconcile == nil || !s.Group.Shards {
		return fmt.Errorf("sharded reconciler %s: needs a Reconcile func and a sharded group", s.Name)
	}
	rt.sharded = append(rt.sharded, s)
	return nil
}

// runSharded is one reconciler's claim loop.
func (rt *Runtime) runSharded(ctx context.Context, s Sharded, loop *health.Loop) {
	poll := rt.cfg.Poll
	if s.Poll > 0 {
		poll = s.Poll
	}
	for {
		loop.Beat()
		if rt.stalledOut() {
			return
		}
		// Taken before the shards are read: a pass that changes them while
		// this iteration claims has closed it by the wait below, which then
		// returns at once instead of after a whole poll.
		changed := rt.renewer.Changed()
		shards := rt.renewer.Shards(s.Group)
		var items []queue.Item
		if len(shards) > 0 {
			// Bounded, so a database that stops answering leaves the loop
			// waiting rather than stuck (a stuck loop would self-release).
			cctx, cancel := context.WithTimeout(ctx, rt.cfg.StatementTimeout)
			var err error
			items, err = queue.Claim(cctx, rt.db, s.Name, rt.client.Owner(), shards, rt.cfg.Batch, rt.cfg.ClaimTTL)
			cancel()
			switch {
			case err == nil, ctx.Err() != nil:
			case coord.Unreachable(err):
				loop.Wait("database unreachable: " + err.Error())
				rt.logger.Warn("claim failed: database unreachable", "reconciler", s.Name, "err", err)
			default:
				rt.logger.Warn("claim failed", "reconciler", s.Name, "err", err)
			}
		}
		for _, it := range items {
			if ctx.Err() != nil {
				return
			}
			rt.runOne(ctx, s, it)
			loop.Beat()
		}
		if len(items) == rt.cfg.Batch {
			continue // more may be due
		}
		select {
		case <-ctx.Done():
			return
		case <-changed:
		case <-rt.clock.After(poll):
		}
	}
}

func (rt *Runtime) runOne(ctx context.Context, s Sharded, it queue.Item) {
	lease, ok := rt.renewer.Lease(s.Group.ShardLease(it.Shard))
	if !ok {
		// The shard moved since the claim: leave the key to the new holder.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		_, _ = queue.ReleaseClaim(rctx, rt.db, it)
		return
	}
	start := rt.clock.Now()
	ac := &afterCommit{}
	err := coord.RunFenced(ctx, rt.db, lease, rt.fenceOptions(),
		func(ctx context.Context, tx pgx.Tx) error {
			ac.fns = ac.fns[:0] // a retried attempt starts afresh
			ctx = context.WithValue(ctx, leaseKey{}, lease)
			ctx = context.WithValue(ctx, afterCommitKey{}, ac)
			if err := s.Reconcile(ctx, tx, it.Key); err != nil {
				return err
			}
			_, err := queue.Complete(ctx, tx, it)
			return err
		})
	rt.m.runSeconds.WithLabelValues(s.Name).Observe(rt.clock.Since(start).Seconds())
	switch {
	case err == nil:
		rt.m.runs.WithLabelValues(s.Name, "ok").Inc()
		for _, fn := range ac.fns {
			fn()
		}
	case errors.Is(err, coord.ErrLeaseLost):
		rt.m.runs.WithLabelValues(s.Name, "lease_lost").Inc()
		rt.m.fenceFailures.WithLabelValues("shard").Inc()
		rt.logger.Warn("reconcile refused by the fence: shard lease lost", "reconciler", s.Name, "key", it.Key, "lease", lease.Name, "epoch", lease.Epoch)
	case ctx.Err() != nil:
		// Stopping: the claim is handed back on the way out.
	default:
		rt.m.runs.WithLabelValues(s.Name, "error").Inc()
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		due, ferr := queue.Fail(fctx, rt.db, it, err, rt.cfg.Backoff)
		rt.logger.Warn("reconcile failed; retrying later", "reconciler", s.Name, "key", it.Key, "attempts", it.Attempts, "retry_at", due, "err", err, "record_err", ferr)
	}
}
