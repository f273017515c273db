// Package nodereg keeps the nodes and their credentials in PostgreSQL:
// Register inserts a node with a fresh credential (pkg/nodeauth's format),
// Verify authenticates the credential a daemon presents on Hello
// (docs/design.md#gateways), Revoke ends a node's every credential. Verify
// hashes the presented credential and compares it with every live hash of
// the node in constant time.
package nodereg

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/pkg/nodeauth"
)

// ErrUnauthenticated is returned by Verify for an unknown node, a revoked
// node or credential, or a wrong credential: callers must not tell them apart
// to the client.
var ErrUnauthenticated = errors.New("node credential not accepted")

// Node describes a node to register.
type Node struct {
	// ID is the node's id (see ValidateNodeID).
	ID string
	// Kind is "node" (default) or "site_agent".
	Kind string
	// SiteID is the node's bare-metal site, if any.
	SiteID string
}

// Register inserts the node (when missing) and a fresh credential for it,
// and returns the credential. It is the only time the credential exists in
// clear; store it on the node.
func Register(ctx context.Context, db Beginner, n Node) (string, error) {
	if err := nodeauth.ValidateNodeID(n.ID); err != nil {
		return "", err
	}
	kind := n.Kind
	if kind == "" {
		kind = "node"
	}
	if kind != "node" && kind != "site_agent" {
		return "", fmt.Errorf("node kind %q must be node or site_agent", kind)
	}
	cred, err := nodeauth.NewCredential()
	if err != nil {
		return "", err
	}
	var site *string
	if n.SiteID != "" {
		site = &n.SiteID
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return "", fmt.Errorf("register node %s: %w", n.ID, err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, `
INSERT INTO nodes (id, kind, site_id) VALUES ($1, $2, $3)
ON CONFLICT (id) DO NOTHING`, n.ID, kind, site); err != nil {
		return "", fmt.Errorf("register node %s: %w", n.ID, err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO node_credentials (node_id, credential_hash) VALUES ($1, $2)`, n.ID, nodeauth.Hash(cred)); err != nil {
		return "", fmt.Errorf("register credential of node %s: %w", n.ID, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return "", fmt.Errorf("register node %s: %w", n.ID, err)
	}
	return cred, nil
}

// Revoke revokes every live credential of the node at once, those still in
// a rotation's grace period (revoked_at in the future) included, and marks
// the node revoked.
func Revoke(ctx context.Context, db Beginner, nodeID string) error {
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("revoke node %s: %w", nodeID, err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, RevokeLiveSQL, nodeID); err != nil {
		return fmt.Errorf("revoke node %s: %w", nodeID, err)
	}
	if _, err := tx.Exec(ctx, `UPDATE nodes SET state = 'revoked', updated_at = compute_now() WHERE id = $1`, nodeID); err != nil {
		return fmt.Errorf("revoke node %s: %w", nodeID, err)
	}
	return tx.Commit(ctx)
}

// Identity is a verified node.
type Identity struct {
	// NodeID is the authenticated node's id.
	NodeID string
	// Kind is the registered kind ("node" or "site_agent").
	Kind string
	// SiteID is the registered site ("" when none).
	SiteID string
}

// A credential is live while revoked_at IS NULL OR revoked_at >
// compute_now(): RotateCredential revokes the old credential in the future,
// so it keeps working for a grace period. The statements spell that
// predicate as coalesce(revoked_at, 'infinity') > (SELECT compute_now()), a
// range of the index node_credentials_unexpired_idx (migration 00026) after
// node_id: Verify, on every Hello, reads only the node's live credentials
// however many it has rotated through. (SELECT compute_now()) is evaluated
// once per statement, which lets the comparison be an index condition.
const liveHashesSQL = `
SELECT n.kind, coalesce(n.site_id, ''), c.credential_hash
  FROM nodes n JOIN node_credentials c ON c.node_id = n.id
 WHERE n.id = $1 AND n.state <> 'revoked'
   AND coalesce(c.revoked_at, 'infinity'::timestamptz) > (SELECT compute_now())`

// RevokeLiveSQL revokes every live credential of node $1 now, including
// those a rotation left live until a future revoked_at. Callers run it in
// the transaction that marks the node revoked.
const RevokeLiveSQL = `
UPDATE node_credentials SET revoked_at = compute_now()
 WHERE node_id = $1 AND coalesce(revoked_at, 'infinity'::timestamptz) > (SELECT compute_now())`

// Verify authenticates nodeID with credential: it succeeds only when the
// node is not revoked and the credential is one of its live credentials (not
// revoked, or revoked at a time still in the future by the database clock,
// a rotation's grace). It only reads. Any refusal is ErrUnauthenticated,
// whatever the reason; other errors are database errors.
func Verify(ctx context.Context, db RowsQuerier, nodeID, credential string) (Identity, error) {
	if nodeauth.ValidateNodeID(nodeID) != nil || len(credential) == 0 || len(credential) > nodeauth.MaxCredentialLen ||
		!strings.HasPrefix(credential, nodeauth.Prefix) {
		return Identity{}, ErrUnauthenticated
	}
	want := nodeauth.Hash(credential)
	rows, err := db.Query(ctx, liveHashesSQL, nodeID)
	if err != nil {
		return Identity{}, fmt.Errorf("verify node %s: %w", nodeID, err)
	}
	defer rows.Close()
	var (
		id    Identity
		match int
	)
	for rows.Next() {
		var hash []byte
		if err := rows.Scan(&id.Kind, &id.SiteID, &hash); err != nil {
			return Identity{}, fmt.Errorf("verify node %s: %w", nodeID, err)
		}
		// Compare every live hash (no early exit) so timing does not tell
		// which credential matched.
		match |= subtle.ConstantTimeCompare(hash, want)
	}
	if err := rows.Err(); err != nil {
		return Identity{}, fmt.Errorf("verify node %s: %w", nodeID, err)
	}
	if match != 1 {
		return Identity{}, ErrUnauthenticated
	}
	id.NodeID = nodeID
	return id, nil
}

// Beginner starts transactions (a pool, a connection or a transaction).
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// RowsQuerier runs queries (a pool, a connection or a transaction).
type RowsQuerier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}
