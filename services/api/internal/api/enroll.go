package api

import (
	"context"
	"errors"
	"fmt"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"

	enrollv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/enroll/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/enroll/v1/enrollv1connect"
	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/nodereg"
	"github.com/leasehold/leasehold/pkg/pgdb"
)

// EnrollmentService (proto/leasehold/enroll/v1) is served beside
// ControlService without an api bearer token: Join is authenticated by the
// join token it carries, RotateCredential by the node's current credential
// (docs/api.md, "Enrollment").
var _ enrollv1connect.EnrollmentServiceHandler = (*Handler)(nil)

const (
	defaultRotateGrace = 10 * time.Minute
	maxRotateGrace     = 24 * time.Hour
	// maxLiveCredentials bounds how many live credentials (the current one
	// and those in a grace) RotateCredential lets a node pile up, so a node
	// rotating in a loop cannot make its own Hello slow.
	maxLiveCredentials = 8
	maxHostnameLen     = 255
	// enrollMaxMessageBytes caps an EnrollmentService request: its callers
	// are not authenticated before the body is read, and a Join with 64
	// labels at their largest fits in it.
	enrollMaxMessageBytes = 64 << 10
)

// errJoinTokenUnknown answers a token that is malformed, has no row, or
// whose secret does not match: the three are not told apart.
var errJoinTokenUnknown = errors.New("join token unknown: ask an admin for a token (leasehold-api join-token create)")

func enrollRefused(err error) error { return connect.NewError(connect.CodeUnauthenticated, err) }

// lockJoinTokenForJoinSQL reads a token for Join and holds its row until
// the join commits, so concurrent joins count its uses one at a time.
const lockJoinTokenForJoinSQL = `
SELECT secret_hash, labels, coalesce(pool_id, ''), max_uses, uses, expires_at, revoked_at IS NOT NULL,
       expires_at <= compute_now()
  FROM join_tokens WHERE id = $1 FOR UPDATE`

const useJoinTokenSQL = `UPDATE join_tokens SET uses = uses + 1 WHERE id = $1`

// lockNodeForJoinSQL locks an existing node against every other change
// (RevokeNode takes the same lock) and says whether it may re-enroll now.
const lockNodeForJoinSQL = `
SELECT state, kind, coalesce(reenroll_until > compute_now(), false) FROM nodes WHERE id = $1 FOR UPDATE`

const clearReenrollSQL = `UPDATE nodes SET reenroll_until = NULL, updated_at = compute_now() WHERE id = $1`

// joinToken is a locked join_tokens row as Join reads it.
type joinToken struct {
	hash             []byte
	labels           map[string]string
	poolID           string
	maxUses, uses    int32
	expiresAt        time.Time
	revoked, expired bool
}

// lockJoinToken finds, locks and checks the token: UNAUTHENTICATED, saying
// which, for an unknown, revoked, expired or used-up one.
func lockJoinToken(ctx context.Context, tx pgx.Tx, token string) (string, joinToken, error) {
	var t joinToken
	id, ok := joinTokenID(token)
	if !ok {
		return "", t, enrollRefused(errJoinTokenUnknown)
	}
	var labels []byte
	err := tx.QueryRow(ctx, lockJoinTokenForJoinSQL, id).Scan(&t.hash, &labels, &t.poolID, &t.maxUses, &t.uses, &t.expiresAt,
		&t.revoked, &t.expired)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", t, enrollRefused(errJoinTokenUnknown)
	}
	if err != nil {
		return "", t, fmt.Errorf("lock join token %s: %w", id, err)
	}
	// The secret first: a caller who knows only the (public) id learns nothing.
	if !sameJoinToken(t.hash, token) {
		return "", t, enrollRefused(errJoinTokenUnknown)
	}
	switch {
	case t.revoked:
		return id, t, enrollRefused(fmt.Errorf("join token revoked (id %s)", id))
	case t.expired:
		return id, t, enrollRefused(fmt.Errorf("join token expired at %s (id %s)", t.expiresAt.UTC().Format(time.RFC3339), id))
	case t.uses >= t.maxUses:
		return id, t, enrollRefused(fmt.Errorf("join token used up: %d of %d uses (id %s)", t.uses, t.maxUses, id))
	}
	if t.labels, err = decodeLabels(labels); err != nil {
		return "", t, fmt.Errorf("join token %s: %w", id, err)
	}
	return id, t, nil
}

func validateJoin(m *enrollv1.JoinRequest) error {
	if m.GetToken() == "" {
		return invalid("token", "is required (lhj_<id>.<secret>)")
	}
	if err := nodeauth.ValidateNodeID(m.GetNodeId()); err != nil {
		return invalid("node_id", "%v", err)
	}
	if len(m.GetHostname()) > maxHostnameLen {
		return invalid("hostname", "must be at most %d bytes", maxHostnameLen)
	}
	if err := checkText("hostname", m.GetHostname(), maxHostnameLen); err != nil {
		return err
	}
	return checkLabels("labels", m.GetLabels())
}

// Join exchanges a join token for a node credential in one transaction:
// it locks the token (UNAUTHENTICATED for an unknown, revoked, expired or
// used-up one, saying which), creates the node with the token's labels
// over the machine's and the token's pool (or, for an existing node an
// admin allowed to re-enroll, revokes its live credentials and closes its
// session), counts the use, stores the new credential's hash and an audit
// row, and commits. An existing node without that permission is
// ALREADY_EXISTS, a revoked node FAILED_PRECONDITION; a refused or invalid
// Join writes nothing and uses nothing. The credential exists in clear only
// in the response.
func (h *Handler) Join(ctx context.Context, req *connect.Request[enrollv1.JoinRequest]) (*connect.Response[enrollv1.JoinResponse], error) {
	m := req.Msg
	if err := validateJoin(m); err != nil {
		return nil, err
	}
	cred, err := nodeauth.NewCredential()
	if err != nil {
		return nil, h.fail(ctx, "join", err)
	}
	nodeID := m.GetNodeId()
	var (
		tokenID    string
		reenrolled bool
	)
	err = pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error {
		id, tok, err := lockJoinToken(ctx, tx, m.GetToken())
		tokenID = id
		if err != nil {
			return err
		}
		var (
			state, kind string
			mayReenroll bool
		)
		err = tx.QueryRow(ctx, lockNodeForJoinSQL, nodeID).Scan(&state, &kind, &mayReenroll)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			_, err = insertNode(ctx, tx, newNode{ID: nodeID, Kind: "node", PoolID: tok.poolID, Assigned: tok.labels,
				Reported: m.GetLabels()}, cred)
			if errors.Is(err, errNodeExists) { // created by a concurrent call since our read
				return nodeExists(nodeID)
			}
			if err != nil {
				return err
			}
		case err != nil:
			return fmt.Errorf("lock node %s: %w", nodeID, err)
		case state == "revoked":
			return connect.NewError(connect.CodeFailedPrecondition,
				fmt.Errorf("node_id: node %q is revoked; a revoked node cannot join again", nodeID))
		case !mayReenroll:
			return nodeExists(nodeID)
		case kind != "node":
			return connect.NewError(connect.CodeFailedPrecondition,
				fmt.Errorf("node_id: node %q is a %s; Join enrolls nodes only", nodeID, kind))
		default:
			reenrolled = true
			if _, err := tx.Exec(ctx, revokeCredentialsSQL, nodeID); err != nil {
				return fmt.Errorf("revoke credentials of node %s: %w", nodeID, err)
			}
			if _, err := tx.Exec(ctx, clearReenrollSQL, nodeID); err != nil {
				return fmt.Errorf("re-enroll node %s: %w", nodeID, err)
			}
			if _, err := tx.Exec(ctx, closeRevokedSessionSQL, nodeID); err != nil {
				return fmt.Errorf("close session of node %s: %w", nodeID, err)
			}
			if _, err := tx.Exec(ctx, insertCredentialSQL, nodeID, nodeauth.Hash(cred)); err != nil {
				return fmt.Errorf("insert credential of node %s: %w", nodeID, err)
			}
		}
		if _, err := tx.Exec(ctx, useJoinTokenSQL, id); err != nil {
			return fmt.Errorf("count a use of join token %s: %w", id, err)
		}
		return h.recordAudit(ctx, tx, auditEvent{Method: "Join", TargetKind: "node", TargetID: nodeID,
			Actor: "join-token:" + id, Role: "join-token",
			Detail: map[string]any{"hostname": m.GetHostname(), "reenrolled": reenrolled, "pool_id": tok.poolID,
				"use": tok.uses + 1, "max_uses": tok.maxUses}})
	})
	if err != nil {
		if connect.CodeOf(err) == connect.CodeUnauthenticated || connect.CodeOf(err) == connect.CodeAlreadyExists ||
			connect.CodeOf(err) == connect.CodeFailedPrecondition {
			h.log.WarnContext(ctx, "join refused", "node", nodeID, "join_token", tokenID, "peer", req.Peer().Addr,
				"code", connect.CodeOf(err).String(), "err", err)
		}
		return nil, h.fail(ctx, "join", err)
	}
	return connect.NewResponse(&enrollv1.JoinResponse{NodeId: nodeID, Credential: cred, Reenrolled: reenrolled}), nil
}

func nodeExists(id string) error {
	return connect.NewError(connect.CodeAlreadyExists,
		fmt.Errorf("node %s exists; an admin must allow it to re-enroll (AllowReenroll)", id))
}

// lockNodeForRotateSQL holds off a RevokeNode (FOR UPDATE) until the
// rotation commits, and a rotation until a revoke in flight has committed.
const lockNodeForRotateSQL = `SELECT 1 FROM nodes WHERE id = $1 FOR KEY SHARE`

// retireCredentialSQL gives the presented credential its grace: it dies
// at compute_now() + $3 µs, or sooner if it was to die sooner already (a
// credential in its grace cannot extend itself by rotating again).
const retireCredentialSQL = `
UPDATE node_credentials
   SET revoked_at = LEAST(coalesce(revoked_at, 'infinity'::timestamptz), compute_now() + $3::bigint * interval '1 microsecond')
 WHERE node_id = $1 AND credential_hash = $2
   AND coalesce(revoked_at, 'infinity'::timestamptz) > (SELECT compute_now())
RETURNING revoked_at`

const countLiveCredentialsSQL = `
SELECT count(*) FROM node_credentials
 WHERE node_id = $1 AND coalesce(revoked_at, 'infinity'::timestamptz) > (SELECT compute_now())`

var errCredentialRefused = errors.New("node credential not accepted")

// RotateCredential authenticates node_id with credential (nodereg.Verify:
// UNAUTHENTICATED for anything else, a revoked node included), then in the
// same transaction stores a new credential and makes the presented one
// expire after grace (0..24h, default 10m) by the database clock, with an
// audit row. The new credential exists in clear only in the response.
func (h *Handler) RotateCredential(ctx context.Context, req *connect.Request[enrollv1.RotateCredentialRequest]) (*connect.Response[enrollv1.RotateCredentialResponse], error) {
	m := req.Msg
	grace := defaultRotateGrace
	if m.Grace != nil {
		var err error
		if grace, err = checkDuration("grace", m.GetGrace(), 0, maxRotateGrace); err != nil {
			return nil, err
		}
	}
	nodeID := m.GetNodeId()
	if nodeauth.ValidateNodeID(nodeID) != nil {
		return nil, enrollRefused(errCredentialRefused)
	}
	cred, err := nodeauth.NewCredential()
	if err != nil {
		return nil, h.fail(ctx, "rotate credential", err)
	}
	var until time.Time
	err = pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, lockNodeForRotateSQL, nodeID).Scan(new(int)); errors.Is(err, pgx.ErrNoRows) {
			return enrollRefused(errCredentialRefused)
		} else if err != nil {
			return fmt.Errorf("lock node %s: %w", nodeID, err)
		}
		if _, err := nodereg.Verify(ctx, tx, nodeID, m.GetCredential()); errors.Is(err, nodereg.ErrUnauthenticated) {
			return enrollRefused(errCredentialRefused)
		} else if err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, retireCredentialSQL, nodeID, nodeauth.Hash(m.GetCredential()), grace.Microseconds()).Scan(&until); errors.Is(err, pgx.ErrNoRows) {
			return enrollRefused(errCredentialRefused) // it died since Verify read it
		} else if err != nil {
			return fmt.Errorf("retire credential of node %s: %w", nodeID, err)
		}
		var live int
		if err := tx.QueryRow(ctx, countLiveCredentialsSQL, nodeID).Scan(&live); err != nil {
			return fmt.Errorf("count credentials of node %s: %w", nodeID, err)
		}
		if live >= maxLiveCredentials {
			return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf(
				"node %s has %d live credentials (at most %d): wait for a grace to end or rotate with a shorter grace", nodeID, live, maxLiveCredentials))
		}
		if _, err := tx.Exec(ctx, insertCredentialSQL, nodeID, nodeauth.Hash(cred)); err != nil {
			return fmt.Errorf("insert credential of node %s: %w", nodeID, err)
		}
		return h.recordAudit(ctx, tx, auditEvent{Method: "RotateCredential", TargetKind: "node", TargetID: nodeID,
			Actor: "node:" + nodeID, Role: "node",
			Detail: map[string]any{"grace": grace.String(), "old_valid_until": until.UTC().Format(time.RFC3339Nano)}})
	})
	if err != nil {
		if connect.CodeOf(err) == connect.CodeUnauthenticated {
			h.log.WarnContext(ctx, "credential rotation refused", "node", nodeID, "peer", req.Peer().Addr)
		}
		return nil, h.fail(ctx, "rotate credential", err)
	}
	return connect.NewResponse(&enrollv1.RotateCredentialResponse{Credential: cred, OldValidUntil: ts(until)}), nil
}
