// Package nodestate moves nodes between connected, disconnected and
// unreachable (docs/design.md#gateways). The node reconciler is sharded by node
// id; a periodic singleton scan enqueues the nodes whose transition is due.
//
// Every transition carries the session epoch it observed, so a concurrent
// Hello (which bumps the epoch) always wins: the guarded UPDATE then matches
// no row and nothing changes. No transition touches an allocation.
package nodestate

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/queue"
	"github.com/leasehold/leasehold/pkg/reconcile"
)

// Reconciler is the work_queue reconciler name of node keys.
const Reconciler = "nodes"

// Config holds the node-state timings.
type Config struct {
	// GatewayLossGrace is added to the session lease before a node whose
	// gateway was lost is marked unreachable (120 s).
	GatewayLossGrace time.Duration
	// ScanEvery is the scan's period (5 s).
	ScanEvery time.Duration
	// ScanLimit bounds the keys one scan enqueues.
	ScanLimit int
}

// DefaultConfig is the defaults of docs/design.md#timings.
func DefaultConfig() Config {
	return Config{GatewayLossGrace: 120 * time.Second, ScanEvery: 5 * time.Second, ScanLimit: 10000}
}

// RegisterFlags registers the flags under prefix.
func (c *Config) RegisterFlags(prefix string, f *flag.FlagSet) {
	f.DurationVar(&c.GatewayLossGrace, prefix+"gateway-loss-grace", c.GatewayLossGrace, "extra time before a node whose gateway was lost is marked unreachable")
	f.DurationVar(&c.ScanEvery, prefix+"scan-interval", c.ScanEvery, "how often the node scan looks for due transitions")
	f.IntVar(&c.ScanLimit, prefix+"scan-limit", c.ScanLimit, "nodes one scan enqueues at most")
}

// Validate checks the configuration.
func (c Config) Validate() error {
	if c.GatewayLossGrace < 0 || c.ScanEvery < 10*time.Millisecond || c.ScanLimit < 1 {
		return fmt.Errorf("nodes: gateway-loss-grace %s must be >= 0, scan-interval %s >= 10ms, scan-limit %d >= 1",
			c.GatewayLossGrace, c.ScanEvery, c.ScanLimit)
	}
	return nil
}

// Register adds the node reconciler and the scan to rt.
func Register(rt *reconcile.Runtime, cfg Config) error {
	if err := rt.RegisterSharded(reconcile.Sharded{Name: Reconciler, Group: coord.Controllers,
		Reconcile: func(ctx context.Context, tx pgx.Tx, key string) error { return Reconcile(ctx, tx, key, cfg) }}); err != nil {
		return err
	}
	return rt.RegisterPeriodic("node-scan", cfg.ScanEvery, func(ctx context.Context, tx pgx.Tx, _ int64) error {
		_, err := Scan(ctx, tx, cfg)
		return err
	})
}

var scanSQL = `
SELECT s.node_id
  FROM node_sessions s
  JOIN nodes n ON n.id = s.node_id
 WHERE n.state IN ('connected', 'disconnected')
   AND (
     (s.state = 'connected' AND (NOT ` + coord.GatewayLeaseLive("s.gateway_id") + ` OR s.session_expires_at < compute_now()))
     OR (s.state = 'disconnected' AND n.state = 'connected')
     OR (s.state = 'disconnected' AND compute_now() > s.session_expires_at
           + CASE WHEN s.close_reason = 'gateway_lost' THEN make_interval(secs => $1::float8) ELSE interval '0' END)
   )
 LIMIT $2`

// Scan enqueues every node whose transition is due and returns how many.
func Scan(ctx context.Context, tx pgx.Tx, cfg Config) (int, error) {
	rows, err := tx.Query(ctx, scanSQL, cfg.GatewayLossGrace.Seconds(), cfg.ScanLimit)
	if err != nil {
		return 0, fmt.Errorf("scan node sessions: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return 0, fmt.Errorf("scan node sessions: %w", err)
	}
	if len(ids) == 0 {
		return 0, nil
	}
	return queue.EnqueueMany(ctx, tx, Reconciler, ids, 0)
}

var readSQL = `
SELECT n.state, s.session_epoch, s.state, s.gateway_id, s.session_expires_at, s.close_reason,
       ` + coord.GatewayLeaseLive("s.gateway_id") + ` AS gateway_live,
       compute_now()
  FROM nodes n
  JOIN node_sessions s ON s.node_id = n.id
 WHERE n.id = $1`

type observed struct {
	nodeState    string
	epoch        int64
	sessionState string
	gatewayID    string
	expiresAt    time.Time
	closeReason  *string
	gatewayLive  bool
	now          time.Time
}

// Reconcile applies the transition due for nodeID, if any.
func Reconcile(ctx context.Context, tx pgx.Tx, nodeID string, cfg Config) error {
	var o observed
	err := tx.QueryRow(ctx, readSQL, nodeID).Scan(&o.nodeState, &o.epoch, &o.sessionState, &o.gatewayID,
		&o.expiresAt, &o.closeReason, &o.gatewayLive, &o.now)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil // never connected, or deleted
	}
	if err != nil {
		return fmt.Errorf("read node %s: %w", nodeID, err)
	}
	if o.nodeState != "connected" && o.nodeState != "disconnected" {
		return nil // registered, unreachable or revoked: nothing to do here
	}
	switch {
	case o.sessionState == "connected" && !o.gatewayLive:
		return disconnect(ctx, tx, nodeID, o, "gateway_lost")
	case o.sessionState == "connected" && o.now.After(o.expiresAt):
		return disconnect(ctx, tx, nodeID, o, "session_expired")
	case o.sessionState == "disconnected" && o.nodeState == "connected":
		return disconnect(ctx, tx, nodeID, o, "")
	case o.sessionState == "disconnected":
		grace := time.Duration(0)
		if o.closeReason != nil && *o.closeReason == "gateway_lost" {
			grace = cfg.GatewayLossGrace
		}
		if o.now.After(o.expiresAt.Add(grace)) {
			return markUnreachable(ctx, tx, nodeID, o, grace)
		}
	}
	return nil
}

// disconnect closes the session (when a worker found it dead) and marks the
// node disconnected, both only at the observed epoch.
func disconnect(ctx context.Context, tx pgx.Tx, nodeID string, o observed, reason string) error {
	if reason != "" {
		tag, err := tx.Exec(ctx, `
UPDATE node_sessions SET state = 'disconnected', closed_at = compute_now(), close_reason = $3
 WHERE node_id = $1 AND session_epoch = $2 AND state = 'connected'`, nodeID, o.epoch, reason)
		if err != nil {
			return fmt.Errorf("close session of %s: %w", nodeID, err)
		}
		if tag.RowsAffected() == 0 {
			return nil // a Hello moved the epoch: it wins
		}
	}
	tag, err := tx.Exec(ctx, `
UPDATE nodes SET state = 'disconnected', updated_at = compute_now()
 WHERE id = $1 AND state = 'connected' AND state_epoch = $2
   AND EXISTS (SELECT 1 FROM node_sessions WHERE node_id = $1 AND session_epoch = $2 AND state = 'disconnected')`, nodeID, o.epoch)
	if err != nil {
		return fmt.Errorf("mark %s disconnected: %w", nodeID, err)
	}
	if tag.RowsAffected() == 0 {
		return nil
	}
	why := reason
	if why == "" {
		why = "stream_closed"
	}
	return recordEvent(ctx, tx, nodeID, o, "node.disconnected", map[string]any{"reason": why, "gateway_id": o.gatewayID})
}

func markUnreachable(ctx context.Context, tx pgx.Tx, nodeID string, o observed, grace time.Duration) error {
	tag, err := tx.Exec(ctx, `
UPDATE nodes SET state = 'unreachable', updated_at = compute_now()
 WHERE id = $1 AND state IN ('connected', 'disconnected') AND state_epoch = $2
   AND EXISTS (SELECT 1 FROM node_sessions WHERE node_id = $1 AND session_epoch = $2 AND state = 'disconnected')`, nodeID, o.epoch)
	if err != nil {
		return fmt.Errorf("mark %s unreachable: %w", nodeID, err)
	}
	if tag.RowsAffected() == 0 {
		return nil
	}
	return recordEvent(ctx, tx, nodeID, o, "node.unreachable", map[string]any{
		"gateway_id": o.gatewayID, "session_expired_at": o.expiresAt, "grace_seconds": grace.Seconds()})
}

// recordEvent writes the transition as a node event, idempotent per epoch.
func recordEvent(ctx context.Context, tx pgx.Tx, nodeID string, o observed, kind string, payload map[string]any) error {
	payload["session_epoch"] = o.epoch
	b, err := json.Marshal(payload)
	if err != nil {
		return err
	}
	_, err = tx.Exec(ctx, `
INSERT INTO node_events (node_id, id, kind, payload, occurred_at, gateway_id, session_epoch)
VALUES ($1, $2, $3, $4, compute_now(), $5, $6)
ON CONFLICT (node_id, id) DO NOTHING`, nodeID, fmt.Sprintf("%s@%d", kind, o.epoch), kind, string(b), o.gatewayID, o.epoch)
	if err != nil {
		return fmt.Errorf("record %s for %s: %w", kind, nodeID, err)
	}
	return nil
}
