// Package placer is the pool-lease placer: a sharded reconciler of the
// scheduler group (keys are pool ids, leases scheduler/shard:<n>) that
// allocates connected nodes of a pool to its pending pool leases, oldest
// first.
//
// A node is never allocated twice: node_allocations has the node id as its
// primary key, and every placement runs in a transaction fenced on the
// pool's shard lease, so a placer that paused mid-placement cannot commit
// after another took the shard over; its uncommitted allocations vanish with
// its transaction. A lease that cannot be filled yet keeps the nodes it has
// and is retried when the scan finds it still pending.
//
// A node matches a selector on the union of the labels it reports (Hello)
// and the labels set at registration (its spec). Candidates are locked FOR
// NO KEY UPDATE, which does not conflict with the key-share locks that
// inserts referencing a busy node take (commands, results, events).
//
// A cordoned node (nodes.cordoned_at set by the api's CordonNode, DrainNode
// and DecommissionNode) is never a candidate. The test is in the statement
// that locks the candidates, and a cordon updates the node row, which takes
// a conflicting lock: a node being cordoned is skipped (SKIP LOCKED), one
// cordoned after the statement's snapshot is re-checked on its newest
// version when locked (PostgreSQL re-evaluates the WHERE of a locking read
// on a row changed since the snapshot), and a cordon of a node this placer
// has locked waits until the placement commits, so once CordonNode has
// returned no placement of the node can still commit and a drain sees
// every allocation.
package placer

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/queue"
	"github.com/leasehold/leasehold/pkg/reconcile"
)

// Reconciler is the work_queue name of pool keys (the api enqueues under it).
const Reconciler = "pool-placer"

// Config tunes the placer.
type Config struct {
	// ScanEvery is how often pools with pending leases are enqueued (5 s).
	ScanEvery time.Duration
	// StepDelay slows each allocation down: a fault-injection knob for
	// failover rehearsals (0 in production).
	StepDelay time.Duration
}

// DefaultConfig is the default.
func DefaultConfig() Config { return Config{ScanEvery: 5 * time.Second} }

// RegisterFlags registers the flags under prefix.
func (c *Config) RegisterFlags(prefix string, f *flag.FlagSet) {
	f.DurationVar(&c.ScanEvery, prefix+"scan-interval", c.ScanEvery, "how often pools with pending leases are enqueued")
	f.DurationVar(&c.StepDelay, prefix+"step-delay", c.StepDelay, "pause after each allocation (failover rehearsal only)")
}

// Validate checks the configuration.
func (c Config) Validate() error {
	if c.ScanEvery < 10*time.Millisecond || c.StepDelay < 0 || c.StepDelay > time.Minute {
		return fmt.Errorf("placer: scan-interval %s must be >= 10ms and step-delay %s in [0, 1m]", c.ScanEvery, c.StepDelay)
	}
	return nil
}

// Register adds the placer and its scan to rt.
func Register(rt *reconcile.Runtime, cfg Config) error {
	if err := rt.RegisterSharded(reconcile.Sharded{Name: Reconciler, Group: coord.Scheduler,
		Reconcile: func(ctx context.Context, tx pgx.Tx, poolID string) error {
			_, err := Place(ctx, tx, poolID, cfg)
			return err
		}}); err != nil {
		return err
	}
	return rt.RegisterPeriodic("pool-scan", cfg.ScanEvery, func(ctx context.Context, tx pgx.Tx, _ int64) error {
		rows, err := tx.Query(ctx, "SELECT DISTINCT pool_id FROM pool_leases WHERE state = 'pending' LIMIT 10000")
		if err != nil {
			return fmt.Errorf("scan pending pool leases: %w", err)
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil || len(ids) == 0 {
			return err
		}
		_, err = queue.EnqueueMany(ctx, tx, Reconciler, ids, 0)
		return err
	})
}

type pending struct {
	id       string
	count    int
	selector json.RawMessage
}

// Place allocates nodes of poolID to its pending leases inside tx (fenced on
// the pool's shard lease by the runtime) and returns how many it allocated.
func Place(ctx context.Context, tx pgx.Tx, poolID string, cfg Config) (int, error) {
	lease, _ := reconcile.LeaseFrom(ctx)
	rows, err := tx.Query(ctx, `
SELECT id, count, selector FROM pool_leases
 WHERE pool_id = $1 AND state = 'pending'
 ORDER BY created_at, id
 FOR UPDATE`, poolID)
	if err != nil {
		return 0, fmt.Errorf("read pending leases of pool %s: %w", poolID, err)
	}
	leases, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (pending, error) {
		var p pending
		return p, r.Scan(&p.id, &p.count, &p.selector)
	})
	if err != nil {
		return 0, fmt.Errorf("read pending leases of pool %s: %w", poolID, err)
	}
	placed := 0
	for _, pl := range leases {
		var have int
		if err := tx.QueryRow(ctx, "SELECT count(*) FROM node_allocations WHERE pool_lease_id = $1", pl.id).Scan(&have); err != nil {
			return placed, fmt.Errorf("count allocations of %s: %w", pl.id, err)
		}
		if need := pl.count - have; need > 0 {
			rows, err := tx.Query(ctx, `
SELECT n.id FROM nodes n
 WHERE n.pool_id = $1 AND n.state = 'connected' AND n.cordoned_at IS NULL
   AND (n.labels || coalesce(n.spec -> 'labels', '{}'::jsonb)) @> $2::jsonb
   AND NOT EXISTS (SELECT 1 FROM node_allocations a WHERE a.node_id = n.id)
 ORDER BY n.id
 LIMIT $3
 FOR NO KEY UPDATE OF n SKIP LOCKED`, poolID, string(orEmpty(pl.selector)), need)
			if err != nil {
				return placed, fmt.Errorf("find nodes for %s: %w", pl.id, err)
			}
			nodes, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				return placed, fmt.Errorf("find nodes for %s: %w", pl.id, err)
			}
			for _, n := range nodes {
				if _, err := tx.Exec(ctx, `
INSERT INTO node_allocations (node_id, pool_lease_id, pool_id, placer_epoch, placed_by) VALUES ($1, $2, $3, $4, $5)`,
					n, pl.id, poolID, lease.Epoch, lease.Owner); err != nil {
					return placed, fmt.Errorf("allocate %s to %s: %w", n, pl.id, err)
				}
				placed++
				have++
				if cfg.StepDelay > 0 {
					select {
					case <-ctx.Done():
						return placed, ctx.Err()
					case <-time.After(cfg.StepDelay):
					}
				}
			}
		}
		if have >= pl.count {
			if _, err := tx.Exec(ctx, "UPDATE pool_leases SET state = 'allocated', allocated_at = compute_now() WHERE id = $1", pl.id); err != nil {
				return placed, fmt.Errorf("mark %s allocated: %w", pl.id, err)
			}
		}
	}
	return placed, nil
}

func orEmpty(b json.RawMessage) json.RawMessage {
	if len(b) == 0 || string(b) == "null" {
		return json.RawMessage("{}")
	}
	return b
}
