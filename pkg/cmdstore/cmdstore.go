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
// updates (FOR NO KEY UPDATE). It returns the node's state, compute_now(),
// the clock a deadline is counted on, and the node's pending commands
// counted up to $2 (0 counts nothing: a caller without a queue cap pays
// nothing for it; with a cap the count stops at the cap, so a full queue
// costs as much as the cap, not as its length).
const LockNodeSQL = `
SELECT n.state, compute_now(),
       (SELECT count(*) FROM (SELECT 1 FROM commands c WHERE c.node_id = n.id AND c.state = 'pending' LIMIT $2) q)
  FROM nodes n WHERE n.id = $1 FOR KEY SHARE OF n`

// LockNodesSQL is LockNodeSQL for several nodes at once ($1, an array of
// ids; $2 the count's cap): one row per node found, in id order (the order
// every multi-node lock takes), with its id, state, compute_now() and its
// pending commands counted up to $2. A node not found has no row.
const LockNodesSQL = `
SELECT n.id, n.state, compute_now(),
       (SELECT count(*) FROM (SELECT 1 FROM commands c WHERE c.node_id = n.id AND c.state = 'pending' LIMIT $2) q)
  FROM nodes n WHERE n.id = ANY($1::text[]) ORDER BY n.id FOR KEY SHARE OF n`

// InsertRowsSQL inserts commands without idempotency keys whose ids the
// caller chose, one per element of its arrays: $1 ids, $2 nodes, $3 kinds,
// $4 payloads, $5 deadlines, $6 traceparents (NULL elements for none). The
// caller holds each node's LockNodesSQL lock and appends its RETURNING
// clause; rows come back in no particular order, so a caller matches them
// by id.
const InsertRowsSQL = `
INSERT INTO commands (id, node_id, kind, payload, deadline, traceparent)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::timestamptz[], $6::text[])`

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
		state  string
		now    time.Time
		queued int
	)
	if err := q.QueryRow(ctx, LockNodeSQL, c.NodeID, 0).Scan(&state, &now, &queued); errors.Is(err, pgx.ErrNoRows) {
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
	return byKey(ctx, q, c)
}

// byKey reads the command c's idempotency key already names on its node,
// as an Inserted with Created false.
func byKey(ctx context.Context, q pgdb.Querier, c Command) (Inserted, error) {
	var in Inserted
	if err := q.QueryRow(ctx, `SELECT id, kind, payload FROM commands WHERE node_id = $1 AND idempotency_key = $2`,
		c.NodeID, c.IdempotencyKey).Scan(&in.ID, &in.Kind, &in.Payload); err != nil {
		return Inserted{}, fmt.Errorf("read command of key %q for %s: %w", c.IdempotencyKey, c.NodeID, err)
	}
	return in, nil
}

// insertManySQL inserts a batch of keyed commands in one statement: it
// takes every named node's KEY SHARE lock first (as LockNodeSQL does for
// one), inserts the commands of the nodes that exist and are not revoked,
// in the order given, and returns each input's position with its node's
// state (empty for none) and the id inserted (NULL when the key was already
// taken or the node refused). $4 are the timeouts in seconds, counted
// from compute_now().
const insertManySQL = `
WITH n AS (
  SELECT id, state FROM nodes WHERE id = ANY($1::text[]) ORDER BY id FOR KEY SHARE
), c AS (
  SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::float8[], $5::text[], $6::text[])
    WITH ORDINALITY AS c(node_id, kind, payload, timeout_s, key, tp, ord)
), ins AS (
  INSERT INTO commands (node_id, kind, payload, deadline, idempotency_key, traceparent)
  SELECT c.node_id, c.kind, c.payload, compute_now() + make_interval(secs => c.timeout_s), c.key, c.tp
    FROM c JOIN n ON n.id = c.node_id AND n.state <> 'revoked'
   ORDER BY c.ord
  ON CONFLICT (node_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
  RETURNING id, node_id, idempotency_key
)
SELECT c.ord, coalesce(n.state, ''), ins.id
  FROM c LEFT JOIN n ON n.id = c.node_id
  LEFT JOIN ins ON ins.node_id = c.node_id AND ins.idempotency_key = c.key
 ORDER BY c.ord`

// ErrKeyRequired is InsertMany's refusal of a command without an
// idempotency key.
var ErrKeyRequired = errors.New("every command of a batch needs an idempotency key")

// InsertMany is Insert for a batch, in one statement and q's transaction:
// the batch creators (a run starting its next nodes) pay one round trip
// and one statement for all of them instead of two per command. Every
// command needs an IdempotencyKey (ErrKeyRequired otherwise, nothing
// written), and no two may share a node and key. It returns, in cmds'
// order, each command's Inserted and its refusal (ErrNodeNotFound,
// ErrNodeRevoked, wrapped) or nil; a key already taken returns the
// existing command with Created false, as Insert does.
func InsertMany(ctx context.Context, q pgdb.Querier, cmds []Command) ([]Inserted, []error, error) {
	if len(cmds) == 0 {
		return nil, nil, nil
	}
	nodes, kinds, keys, tps := make([]string, len(cmds)), make([]string, len(cmds)), make([]string, len(cmds)), make([]*string, len(cmds))
	payloads, timeouts := make([][]byte, len(cmds)), make([]float64, len(cmds))
	for i, c := range cmds {
		if c.IdempotencyKey == "" {
			return nil, nil, fmt.Errorf("insert command %d for %s: %w", i, c.NodeID, ErrKeyRequired)
		}
		nodes[i], kinds[i], keys[i], tps[i] = c.NodeID, c.Kind, c.IdempotencyKey, nullable(c.Traceparent)
		payloads[i], timeouts[i] = c.Payload, c.Timeout.Seconds()
		if payloads[i] == nil {
			payloads[i] = []byte{}
		}
	}
	rows, err := q.Query(ctx, insertManySQL, nodes, kinds, payloads, timeouts, keys, tps)
	if err != nil {
		return nil, nil, fmt.Errorf("insert %d commands: %w", len(cmds), err)
	}
	out, refused := make([]Inserted, len(cmds)), make([]error, len(cmds))
	var taken []int
	for rows.Next() {
		var (
			ord   int64
			state string
			id    *string
		)
		if err := rows.Scan(&ord, &state, &id); err != nil {
			rows.Close()
			return nil, nil, fmt.Errorf("insert %d commands: %w", len(cmds), err)
		}
		i := int(ord - 1)
		c := cmds[i]
		switch {
		case state == "":
			refused[i] = fmt.Errorf("insert command for %s: %w", c.NodeID, ErrNodeNotFound)
		case state == "revoked":
			refused[i] = fmt.Errorf("insert command for %s: %w", c.NodeID, ErrNodeRevoked)
		case id == nil:
			taken = append(taken, i)
		default:
			out[i] = Inserted{ID: *id, Created: true, Kind: c.Kind, Payload: payloads[i]}
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, nil, fmt.Errorf("insert %d commands: %w", len(cmds), err)
	}
	// Keys already taken: the insert waited for their transactions, so
	// the rows are committed and visible to a new statement.
	for _, i := range taken {
		if out[i], err = byKey(ctx, q, cmds[i]); err != nil {
			return nil, nil, err
		}
	}
	return out, refused, nil
}
