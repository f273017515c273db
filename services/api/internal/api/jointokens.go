package api

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/pgdb"
)

// Join tokens (docs/node.md, "Enrollment"): "lhj_<id>.<secret>", the id 64
// random bits in hex (public: listed, audited, logged), the secret 256 bits
// from crypto/rand in base64url. Only the SHA-256 of the whole token is
// stored; a presented token is hashed and compared in constant time.
const (
	// JoinTokenPrefix starts every join token, so a leaked one is recognisable.
	JoinTokenPrefix      = "lhj_"
	joinTokenIDBytes     = 8
	joinTokenSecretBytes = 32
	// maxJoinTokenLen bounds what Join hashes: prefix, id, dot, secret.
	maxJoinTokenLen = 128

	minJoinTokenTTL     = time.Minute
	maxJoinTokenTTL     = 30 * 24 * time.Hour
	defaultJoinTokenTTL = 24 * time.Hour
	maxJoinTokenUses    = 100000
	// maxJoinTokenDescription is in bytes, as the join_tokens CHECK counts.
	maxJoinTokenDescription = 200
	maxJoinTokenList        = 10000

	minReenrollTTL     = time.Minute
	maxReenrollTTL     = 7 * 24 * time.Hour
	defaultReenrollTTL = time.Hour
	maxReasonChars     = 200
)

// joinTokenIDRE is a join token's id (the join_tokens CHECK).
var joinTokenIDRE = regexp.MustCompile(`^[0-9a-f]{16}$`)

// newJoinToken returns a fresh token and its id.
func newJoinToken() (token, id string, err error) {
	b := make([]byte, joinTokenIDBytes+joinTokenSecretBytes)
	if _, err := rand.Read(b); err != nil {
		return "", "", fmt.Errorf("generate join token: %w", err)
	}
	id = hex.EncodeToString(b[:joinTokenIDBytes])
	return JoinTokenPrefix + id + "." + base64.RawURLEncoding.EncodeToString(b[joinTokenIDBytes:]), id, nil
}

// hashJoinToken is the stored form of a join token.
func hashJoinToken(token string) []byte {
	h := sha256.Sum256([]byte(token))
	return h[:]
}

// joinTokenID returns the id of a token shaped "lhj_<id>.<secret>", or false.
// It never says more: the caller answers every malformed token the same way.
func joinTokenID(token string) (string, bool) {
	if len(token) > maxJoinTokenLen {
		return "", false
	}
	rest, ok := strings.CutPrefix(token, JoinTokenPrefix)
	if !ok {
		return "", false
	}
	id, secret, ok := strings.Cut(rest, ".")
	if !ok || !joinTokenIDRE.MatchString(id) || len(secret) != base64.RawURLEncoding.EncodedLen(joinTokenSecretBytes) {
		return "", false
	}
	return id, true
}

// sameJoinToken compares a presented token with a stored hash in constant time.
func sameJoinToken(stored []byte, token string) bool {
	return subtle.ConstantTimeCompare(stored, hashJoinToken(token)) == 1
}

// joinTokenSpec is a validated CreateJoinToken request.
type joinTokenSpec struct {
	ttl         time.Duration
	maxUses     int32
	labels      map[string]string
	poolID      string
	description string
}

// validateCreateJoinToken checks every field of m (INVALID_ARGUMENT naming
// it) and applies the defaults: ttl 24h, max_uses 1.
func validateCreateJoinToken(m *controlv1.CreateJoinTokenRequest) (joinTokenSpec, error) {
	s := joinTokenSpec{ttl: defaultJoinTokenTTL, maxUses: 1, labels: m.GetLabels(), poolID: m.GetPoolId(), description: m.GetDescription()}
	if m.Ttl != nil {
		var err error
		if s.ttl, err = checkDuration("ttl", m.GetTtl(), minJoinTokenTTL, maxJoinTokenTTL); err != nil {
			return s, err
		}
	}
	switch n := m.GetMaxUses(); {
	case n < 0 || n > maxJoinTokenUses:
		return s, invalid("max_uses", "must be in 1..%d (0 means 1), got %d", maxJoinTokenUses, n)
	case n > 0:
		s.maxUses = n
	}
	if err := checkLabels("labels", m.GetLabels()); err != nil {
		return s, err
	}
	if err := checkOptionalRE("pool_id", m.GetPoolId(), idRE); err != nil {
		return s, err
	}
	if len(m.GetDescription()) > maxJoinTokenDescription {
		return s, invalid("description", "must be at most %d bytes, got %d", maxJoinTokenDescription, len(m.GetDescription()))
	}
	if err := checkText("description", m.GetDescription(), maxJoinTokenDescription); err != nil {
		return s, err
	}
	return s, nil
}

const joinTokenColumns = `id, description, labels, coalesce(pool_id, ''), max_uses, uses, created_at, expires_at, revoked_at`

const insertJoinTokenSQL = `
INSERT INTO join_tokens (id, secret_hash, description, labels, pool_id, max_uses, expires_at)
VALUES ($1, $2, $3, $4::jsonb, $5, $6, compute_now() + $7::bigint * interval '1 microsecond')
RETURNING ` + joinTokenColumns

// listJoinTokensSQL lists tokens newest first; unless $1, only those a
// Join would accept now.
const listJoinTokensSQL = `
SELECT ` + joinTokenColumns + `
  FROM join_tokens
 WHERE $1 OR (revoked_at IS NULL AND expires_at > compute_now() AND uses < max_uses)
 ORDER BY created_at DESC, id DESC LIMIT $2`

const lockJoinTokenSQL = `SELECT revoked_at IS NOT NULL FROM join_tokens WHERE id = $1 FOR UPDATE`

const revokeJoinTokenSQL = `
UPDATE join_tokens SET revoked_at = compute_now() WHERE id = $1 AND revoked_at IS NULL`

const getJoinTokenSQL = `SELECT ` + joinTokenColumns + ` FROM join_tokens WHERE id = $1`

func scanJoinToken(row pgx.Row) (*controlv1.JoinToken, error) {
	var (
		t                controlv1.JoinToken
		labels           []byte
		created, expires time.Time
		revoked          *time.Time
	)
	if err := row.Scan(&t.Id, &t.Description, &labels, &t.PoolId, &t.MaxUses, &t.Uses, &created, &expires, &revoked); err != nil {
		return nil, err
	}
	var err error
	if t.Labels, err = decodeLabels(labels); err != nil {
		return nil, fmt.Errorf("join token %s: %w", t.Id, err)
	}
	t.CreatedAt, t.ExpiresAt, t.RevokedAt = ts(created), ts(expires), tsPtr(revoked)
	return &t, nil
}

// CreateJoinToken stores a new join token and returns it with its secret,
// which exists in clear only in this response. The token works for ttl
// (1m..30d, default 24h) by the database clock, for max_uses joins (1..100000,
// default 1); every node that joins with it gets its labels and pool. An
// unknown pool is NOT_FOUND; nothing is written then.
func (h *Handler) CreateJoinToken(ctx context.Context, req *connect.Request[controlv1.CreateJoinTokenRequest]) (*connect.Response[controlv1.CreateJoinTokenResponse], error) {
	spec, err := validateCreateJoinToken(req.Msg)
	if err != nil {
		return nil, err
	}
	token, id, err := newJoinToken()
	if err != nil {
		return nil, h.fail(ctx, "create join token", err)
	}
	var pool *string
	if spec.poolID != "" {
		pool = &spec.poolID
	}
	var jt *controlv1.JoinToken
	err = pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error {
		if pool != nil {
			if err := tx.QueryRow(ctx, lockPoolSQL, *pool).Scan(new(int)); errors.Is(err, pgx.ErrNoRows) {
				return notFound("pool_id", "pool", *pool)
			} else if err != nil {
				return fmt.Errorf("lock pool %s: %w", *pool, err)
			}
		}
		var err error
		jt, err = scanJoinToken(tx.QueryRow(ctx, insertJoinTokenSQL, id, hashJoinToken(token), spec.description,
			encodeLabels(spec.labels), pool, spec.maxUses, spec.ttl.Microseconds()))
		if err != nil {
			return fmt.Errorf("insert join token: %w", err)
		}
		return h.recordAudit(ctx, tx, auditEvent{Method: "CreateJoinToken", TargetKind: "join_token", TargetID: id,
			Detail: map[string]any{"max_uses": spec.maxUses, "ttl": spec.ttl.String(), "pool_id": spec.poolID,
				"expires_at": jt.GetExpiresAt().AsTime().Format(time.RFC3339)}})
	})
	if err != nil {
		return nil, h.fail(ctx, "create join token", err)
	}
	return connect.NewResponse(&controlv1.CreateJoinTokenResponse{JoinToken: jt, Token: token}), nil
}

// ListJoinTokens lists join tokens newest first, never their secrets: those
// a Join would accept now, or all with include_inactive.
func (h *Handler) ListJoinTokens(ctx context.Context, req *connect.Request[controlv1.ListJoinTokensRequest]) (*connect.Response[controlv1.ListJoinTokensResponse], error) {
	rows, err := h.db.Query(ctx, listJoinTokensSQL, req.Msg.GetIncludeInactive(), maxJoinTokenList)
	if err != nil {
		return nil, h.fail(ctx, "list join tokens", err)
	}
	tokens, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (*controlv1.JoinToken, error) { return scanJoinToken(r) })
	if err != nil {
		return nil, h.fail(ctx, "list join tokens", err)
	}
	return connect.NewResponse(&controlv1.ListJoinTokensResponse{JoinTokens: tokens}), nil
}

// RevokeJoinToken makes a join token unusable from the commit on: a Join
// holding the token's row lock finishes first, any later one is refused.
// Revoking twice is not an error (outcome "unchanged"); an unknown id is
// NOT_FOUND.
func (h *Handler) RevokeJoinToken(ctx context.Context, req *connect.Request[controlv1.RevokeJoinTokenRequest]) (*connect.Response[controlv1.RevokeJoinTokenResponse], error) {
	id := req.Msg.GetId()
	if err := checkRE("id", id, joinTokenIDRE); err != nil {
		return nil, err
	}
	var jt *controlv1.JoinToken
	err := pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error {
		var revoked bool
		if err := tx.QueryRow(ctx, lockJoinTokenSQL, id).Scan(&revoked); errors.Is(err, pgx.ErrNoRows) {
			return notFound("id", "join token", id)
		} else if err != nil {
			return fmt.Errorf("lock join token %s: %w", id, err)
		}
		if !revoked {
			if _, err := tx.Exec(ctx, revokeJoinTokenSQL, id); err != nil {
				return fmt.Errorf("revoke join token %s: %w", id, err)
			}
		}
		var err error
		if jt, err = scanJoinToken(tx.QueryRow(ctx, getJoinTokenSQL, id)); err != nil {
			return fmt.Errorf("read join token %s: %w", id, err)
		}
		return h.recordAudit(ctx, tx, auditEvent{Method: "RevokeJoinToken", TargetKind: "join_token", TargetID: id,
			Outcome: outcome(!revoked)})
	})
	if err != nil {
		return nil, h.fail(ctx, "revoke join token", err)
	}
	return connect.NewResponse(&controlv1.RevokeJoinTokenResponse{JoinToken: jt}), nil
}

const allowReenrollSQL = `
UPDATE nodes SET reenroll_until = compute_now() + $2::bigint * interval '1 microsecond'
 WHERE id = $1 RETURNING reenroll_until`

// AllowReenroll lets an existing, unrevoked node join again under its id
// (EnrollmentService.Join) until ttl (1m..7d, default 1h) from now by the
// database clock; the join replaces its credentials. A second call sets a
// new window. An unknown node is NOT_FOUND, a revoked one
// FAILED_PRECONDITION.
func (h *Handler) AllowReenroll(ctx context.Context, req *connect.Request[controlv1.AllowReenrollRequest]) (*connect.Response[controlv1.AllowReenrollResponse], error) {
	m := req.Msg
	if err := checkRE("node_id", m.GetNodeId(), idRE); err != nil {
		return nil, err
	}
	ttl := defaultReenrollTTL
	if m.Ttl != nil {
		var err error
		if ttl, err = checkDuration("ttl", m.GetTtl(), minReenrollTTL, maxReenrollTTL); err != nil {
			return nil, err
		}
	}
	if err := checkText("reason", m.GetReason(), maxReasonChars); err != nil {
		return nil, err
	}
	var (
		node  *controlv1.Node
		until time.Time
	)
	err := pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error {
		state, err := lockNodeForRevoke(ctx, tx, m.GetNodeId())
		if err != nil {
			return err
		}
		if state == "revoked" {
			return connect.NewError(connect.CodeFailedPrecondition,
				fmt.Errorf("node_id: node %q is revoked; a revoked node cannot enroll again", m.GetNodeId()))
		}
		if err := tx.QueryRow(ctx, allowReenrollSQL, m.GetNodeId(), ttl.Microseconds()).Scan(&until); err != nil {
			return fmt.Errorf("allow node %s to re-enroll: %w", m.GetNodeId(), err)
		}
		if node, err = scanNode(tx.QueryRow(ctx, getNodeSQL, m.GetNodeId())); err != nil {
			return fmt.Errorf("read node %s: %w", m.GetNodeId(), err)
		}
		return h.recordAudit(ctx, tx, auditEvent{Method: "AllowReenroll", TargetKind: "node", TargetID: m.GetNodeId(),
			Detail: map[string]any{"until": until.UTC().Format(time.RFC3339Nano), "reason": m.GetReason()}})
	})
	if err != nil {
		return nil, h.fail(ctx, "allow re-enroll", err)
	}
	return connect.NewResponse(&controlv1.AllowReenrollResponse{Node: node, Until: ts(until)}), nil
}
