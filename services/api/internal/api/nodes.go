package api

import (
	"context"
	"errors"
	"fmt"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/pgdb"
)

func validateRegisterNode(m *controlv1.RegisterNodeRequest) (kind string, err error) {
	if err := checkRE("node_id", m.GetNodeId(), idRE); err != nil {
		return "", err
	}
	switch m.GetKind() {
	case nodev1.NodeKind_NODE_KIND_NODE:
		kind = "node"
	case nodev1.NodeKind_NODE_KIND_SITE_AGENT:
		kind = "site_agent"
		if m.GetSiteId() == "" {
			return "", invalid("site_id", "is required for a site agent")
		}
	default:
		return "", invalid("kind", "must be NODE_KIND_NODE or NODE_KIND_SITE_AGENT")
	}
	if err := checkOptionalRE("site_id", m.GetSiteId(), idRE); err != nil {
		return "", err
	}
	if err := checkLabels("labels", m.GetLabels()); err != nil {
		return "", err
	}
	if err := checkOptionalRE("pool_id", m.GetPoolId(), idRE); err != nil {
		return "", err
	}
	return kind, nil
}

// RegisterNode creates a node and its first credential, returned once and
// stored only as a SHA-256 hash. Registering an existing id is
// ALREADY_EXISTS: rotating a credential is not done by re-registering.
func (h *Handler) RegisterNode(ctx context.Context, req *connect.Request[controlv1.RegisterNodeRequest]) (*connect.Response[controlv1.RegisterNodeResponse], error) {
	m := req.Msg
	kind, err := validateRegisterNode(m)
	if err != nil {
		return nil, err
	}
	cred, err := nodeauth.NewCredential()
	if err != nil {
		return nil, h.fail(ctx, "register node", err)
	}
	var node *controlv1.Node
	err = pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error {
		var err error
		node, err = insertNode(ctx, tx, newNode{ID: m.GetNodeId(), Kind: kind, SiteID: m.GetSiteId(), PoolID: m.GetPoolId(),
			Assigned: m.GetLabels()}, cred)
		if errors.Is(err, errNodeExists) {
			return connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("node_id: node %q already exists", m.GetNodeId()))
		}
		if err != nil {
			return err
		}
		return h.recordAudit(ctx, tx, auditEvent{Method: "RegisterNode", TargetKind: "node", TargetID: node.GetId(),
			Detail: map[string]any{"kind": kind, "pool_id": m.GetPoolId()}})
	})
	if err != nil {
		return nil, h.fail(ctx, "register node", err)
	}
	return connect.NewResponse(&controlv1.RegisterNodeResponse{Node: node, Credential: cred}), nil
}

// newNode is a node to create: RegisterNode's, or a machine's that joins
// with a join token.
type newNode struct {
	ID, Kind       string
	SiteID, PoolID string            // "" for none
	Assigned       map[string]string // labels the control plane assigns (spec.labels)
	Reported       map[string]string // labels the machine reports about itself
}

// errNodeExists is insertNode's answer for an id already taken.
var errNodeExists = errors.New("node exists")

// insertNode creates node n and its first credential cred (stored only as
// its hash) in tx, and returns the node as GetNode shows it. A pool that
// does not exist is NOT_FOUND naming pool_id (the pool stays locked against
// deletion until tx ends); an id already taken is errNodeExists and writes
// nothing. It is the one insert path of nodes: RegisterNode and Join both
// use it.
func insertNode(ctx context.Context, tx pgx.Tx, n newNode, cred string) (*controlv1.Node, error) {
	var site, pool *string
	if n.SiteID != "" {
		site = &n.SiteID
	}
	if n.PoolID != "" {
		pool = &n.PoolID
		if err := tx.QueryRow(ctx, lockPoolSQL, *pool).Scan(new(int)); errors.Is(err, pgx.ErrNoRows) {
			return nil, notFound("pool_id", "pool", *pool)
		} else if err != nil {
			return nil, fmt.Errorf("lock pool %s: %w", *pool, err)
		}
	}
	spec := "{}"
	if len(n.Assigned) > 0 {
		spec = `{"labels":` + encodeLabels(n.Assigned) + `}`
	}
	tag, err := tx.Exec(ctx, insertNodeSQL, n.ID, n.Kind, site, pool, spec, encodeLabels(n.Reported))
	if err != nil {
		return nil, fmt.Errorf("insert node %s: %w", n.ID, err)
	}
	if tag.RowsAffected() == 0 {
		return nil, errNodeExists
	}
	if _, err := tx.Exec(ctx, insertCredentialSQL, n.ID, nodeauth.Hash(cred)); err != nil {
		return nil, fmt.Errorf("insert credential of node %s: %w", n.ID, err)
	}
	node, err := scanNode(tx.QueryRow(ctx, getNodeSQL, n.ID))
	if err != nil {
		return nil, fmt.Errorf("read node %s: %w", n.ID, err)
	}
	return node, nil
}

// RevokeNode revokes every credential of the node, marks it revoked and
// closes its session. Revoking twice is not an error.
func (h *Handler) RevokeNode(ctx context.Context, req *connect.Request[controlv1.RevokeNodeRequest]) (*connect.Response[controlv1.RevokeNodeResponse], error) {
	id := req.Msg.GetNodeId()
	if err := checkRE("node_id", id, idRE); err != nil {
		return nil, err
	}
	var node *controlv1.Node
	err := pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error {
		state, err := lockNodeForRevoke(ctx, tx, id)
		if err != nil {
			return err
		}
		if err := revokeLocked(ctx, tx, id, state); err != nil {
			return err
		}
		if node, err = scanNode(tx.QueryRow(ctx, getNodeSQL, id)); err != nil {
			return err
		}
		return h.recordAudit(ctx, tx, auditEvent{Method: "RevokeNode", TargetKind: "node", TargetID: id,
			Outcome: outcome(state != "revoked")})
	})
	if err != nil {
		return nil, h.fail(ctx, "revoke node", err)
	}
	return connect.NewResponse(&controlv1.RevokeNodeResponse{Node: node}), nil
}

// lockNodeForRevoke locks node id against every other change and returns
// its state; a missing node is NOT_FOUND.
func lockNodeForRevoke(ctx context.Context, tx pgx.Tx, id string) (string, error) {
	var state string
	if err := tx.QueryRow(ctx, lockNodeForRevokeSQL, id).Scan(&state); errors.Is(err, pgx.ErrNoRows) {
		return "", notFound("node_id", "node", id)
	} else if err != nil {
		return "", err
	}
	return state, nil
}

// revokeLocked revokes every credential of node id, which tx has locked in
// state, marks it revoked and closes its session.
func revokeLocked(ctx context.Context, tx pgx.Tx, id, state string) error {
	if _, err := tx.Exec(ctx, revokeCredentialsSQL, id); err != nil {
		return err
	}
	if state != "revoked" {
		if _, err := tx.Exec(ctx, revokeNodeSQL, id); err != nil {
			return err
		}
	}
	_, err := tx.Exec(ctx, closeRevokedSessionSQL, id)
	return err
}

// GetNode returns one node.
func (h *Handler) GetNode(ctx context.Context, req *connect.Request[controlv1.GetNodeRequest]) (*connect.Response[controlv1.GetNodeResponse], error) {
	id := req.Msg.GetNodeId()
	if err := checkRE("node_id", id, idRE); err != nil {
		return nil, err
	}
	node, err := scanNode(h.db.QueryRow(ctx, getNodeSQL, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, notFound("node_id", "node", id)
	}
	if err != nil {
		return nil, h.fail(ctx, "get node", err)
	}
	return connect.NewResponse(&controlv1.GetNodeResponse{Node: node}), nil
}

// ListNodes returns nodes ordered by id.
func (h *Handler) ListNodes(ctx context.Context, req *connect.Request[controlv1.ListNodesRequest]) (*connect.Response[controlv1.ListNodesResponse], error) {
	const method = "ListNodes"
	m := req.Msg
	if err := checkPage(m.GetPageSize(), m.GetPageToken()); err != nil {
		return nil, err
	}
	if err := checkEnum("state", m.GetState(), controlv1.NodeState_name, true); err != nil {
		return nil, err
	}
	if err := checkOptionalRE("pool_id", m.GetPoolId(), idRE); err != nil {
		return nil, err
	}
	p, err := openPage(method, m.GetPageSize(), m.GetPageToken())
	if err != nil {
		return nil, err
	}
	resp := &controlv1.ListNodesResponse{}
	err = h.readList(ctx, "list nodes", func(ctx context.Context, q pgdb.Querier) error {
		rows, err := q.Query(ctx, listNodesSQL, p.after.ID, dbName(nodeStates, m.GetState()), m.GetPoolId(), p.limit(), m.GetCordonedOnly())
		if err != nil {
			return err
		}
		resp.Nodes, resp.NextPageToken, err = collectPage(p, rows, func(r pgx.Rows) (*controlv1.Node, pageKey, error) {
			n, err := scanNode(r)
			return n, pageKey{ID: n.GetId()}, err
		})
		return err
	})
	if err != nil {
		return nil, h.fail(ctx, "list nodes", err)
	}
	return connect.NewResponse(resp), nil
}
