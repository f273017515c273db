// Package cmdstore owns "insert a command": the one INSERT INTO commands
// that both the api's CreateCommand and the worker's runs reconciler use,
// with the node check that comes before it. A command is created pending;
// the gateways' dispatchers pick it up (woken by pkg/cmdwake after the
// commit, or by their poll).
package cmdstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/pkg/pgdb"
)

// LockNodeSQL checks a node and holds off its revocation (which takes FOR
// UPDATE) until the command is in; it does not block the gateway's state
// updates (FOR NO KEY UPDATE). It returns the node's state and
// compute_now(), the clock a deadline is counted on.
const LockNodeSQL = `SELECT state, compute_now() FROM nodes WHERE id = $1 FOR KEY SHARE`

// InsertSQL inserts a command: $1 node, $2 kind, $3 payload, $4 deadline,
// $5 idempotency key (NULL for none), $6 traceparent (NULL for none). A
// caller appends its RETURNING clause. A key already used by the node
// inserts nothing (no row returned).
//
// It names the conflict target with its predicate (WHERE idempotency_key IS
// NOT NULL): it infers today's UNIQUE (node_id, idempotency_key) and
// equally a partial unique index on the keyed rows only, so a later
// migration can stop indexing the keyless majority without breaking a
// process still running this statement (docs/decisions.md, "The
// idempotency index can become partial").
const InsertSQL = `
INSERT INTO commands (node_id, kind, payload, deadline, idempotency_key, traceparent) VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (node_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING`

// ErrNodeNotFound and ErrNodeRevoked are Insert's refusals.
var (
	// ErrNodeNotFound: no node has the id.
	ErrNodeNotFound = errors.New("node not found")
	// ErrNodeRevoked: the node is revoked; it gets no new command.
	ErrNodeRevoked = errors.New("node is revoked")
)

// Command is a command to insert.
type Command struct {
	// NodeID is the node that runs it.
	NodeID string
	// Kind and Payload are what it runs.
	Kind    string
	Payload []byte
	// Timeout is counted from the database's compute_now().
	Timeout time.Duration
	// IdempotencyKey, when not empty, makes the insert idempotent per node.
	IdempotencyKey string
	// Traceparent is the W3C trace context to carry, or empty.
	Traceparent string
}

// Inserted is what Insert did.
type Inserted struct {
	// ID is the command's id (the existing one for a repeated key).
	ID string
	// Created is false when the idempotency key returned an existing command.
	Created bool
	// Kind and Payload are the stored command's (they differ from the
	// request's when a key was reused for other content).
	Kind    string
	Payload []byte
}

func nullable(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// Insert checks the node (FOR KEY SHARE: a concurrent revoke waits) and
// inserts the command with the deadline compute_now() + Timeout, in q's
// transaction. With an IdempotencyKey a repeat returns the first command
// with Created false, whatever its state. The caller wakes the gateways
// (pkg/cmdwake) after its commit.
func Insert(ctx context.Context, q pgdb.Querier, c Command) (Inserted, error) {
	var (
		state string
		now   time.Time
	)
	if err := q.QueryRow(ctx, LockNodeSQL, c.NodeID).Scan(&state, &now); errors.Is(err, pgx.ErrNoRows) {
		return Inserted{}, fmt.Errorf("insert command for %s: %w", c.NodeID, ErrNodeNotFound)
	} else if err != nil {
		return Inserted{}, fmt.Errorf("lock node %s: %w", c.NodeID, err)
	}
	if state == "revoked" {
		return Inserted{}, fmt.Errorf("insert command for %s: %w", c.NodeID, ErrNodeRevoked)
	}
	payload := c.Payload
	if payload == nil {
		payload = []byte{}
	}
	in := Inserted{Created: true, Kind: c.Kind, Payload: payload}
	err := q.QueryRow(ctx, InsertSQL+` RETURNING id`, c.NodeID, c.Kind, payload, now.Add(c.Timeout),
		nullable(c.IdempotencyKey), nullable(c.Traceparent)).Scan(&in.ID)
	if err == nil {
		return in, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) || c.IdempotencyKey == "" {
		return Inserted{}, fmt.Errorf("insert command for %s: %w", c.NodeID, err)
	}
	// The key is taken: the insert waited for the other transaction, so
	// the row is committed and visible to this new statement.
	in.Created = false
	if err := q.QueryRow(ctx, `SELECT id, kind, payload FROM commands WHERE node_id = $1 AND idempotency_key = $2`,
		c.NodeID, c.IdempotencyKey).Scan(&in.ID, &in.Kind, &in.Payload); err != nil {
		return Inserted{}, fmt.Errorf("read command of key %q for %s: %w", c.IdempotencyKey, c.NodeID, err)
	}
	return in, nil
}
