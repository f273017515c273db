package api

import (
	"context"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
)

// ListLeases returns coordination leases ordered by name.
func (h *Handler) ListLeases(ctx context.Context, req *connect.Request[controlv1.ListLeasesRequest]) (*connect.Response[controlv1.ListLeasesResponse], error) {
	const method = "ListLeases"
	m := req.Msg
	if err := checkPage(m.GetPageSize(), m.GetPageToken()); err != nil {
		return nil, err
	}
	if err := checkOptionalRE("name_prefix", m.GetNamePrefix(), leasePrefixRE); err != nil {
		return nil, err
	}
	p, err := openPage(method, m.GetPageSize(), m.GetPageToken())
	if err != nil {
		return nil, err
	}
	rows, err := h.db.Query(ctx, listLeasesSQL, m.GetNamePrefix(), p.after.ID, p.limit())
	if err != nil {
		return nil, h.fail(ctx, "list leases", err)
	}
	resp := &controlv1.ListLeasesResponse{}
	resp.Leases, resp.NextPageToken, err = collectPage(p, rows, func(r pgx.Rows) (*controlv1.Lease, pageKey, error) {
		var (
			l       controlv1.Lease
			expires pgtype.Timestamptz
		)
		if err := r.Scan(&l.Name, &l.Owner, &l.Epoch, &expires, &l.Expired); err != nil {
			return nil, pageKey{}, err
		}
		l.ExpiresAt = tsFinite(expires)
		return &l, pageKey{ID: l.GetName()}, nil
	})
	if err != nil {
		return nil, h.fail(ctx, "list leases", err)
	}
	return connect.NewResponse(resp), nil
}

// ListWorkers returns the membership rows, ordered by group then id.
func (h *Handler) ListWorkers(ctx context.Context, req *connect.Request[controlv1.ListWorkersRequest]) (*connect.Response[controlv1.ListWorkersResponse], error) {
	if err := checkOptionalRE("group", req.Msg.GetGroup(), groupRE); err != nil {
		return nil, err
	}
	rows, err := h.db.Query(ctx, listWorkersSQL, req.Msg.GetGroup())
	if err != nil {
		return nil, h.fail(ctx, "list workers", err)
	}
	defer rows.Close()
	resp := &controlv1.ListWorkersResponse{}
	for rows.Next() {
		var (
			w         controlv1.Worker
			heartbeat pgtype.Timestamptz
			skewMs    int64
		)
		if err := rows.Scan(&w.Id, &w.Group, &heartbeat, &skewMs, &w.Live); err != nil {
			return nil, h.fail(ctx, "list workers", err)
		}
		w.HeartbeatAt, w.ClockSkew = tsFinite(heartbeat), durationMs(skewMs)
		resp.Workers = append(resp.Workers, &w)
	}
	if err := rows.Err(); err != nil {
		return nil, h.fail(ctx, "list workers", err)
	}
	return connect.NewResponse(resp), nil
}

// ListGateways returns the gateways (their gateway:<id> leases) with the
// number of connected sessions each holds.
func (h *Handler) ListGateways(ctx context.Context, _ *connect.Request[controlv1.ListGatewaysRequest]) (*connect.Response[controlv1.ListGatewaysResponse], error) {
	rows, err := h.db.Query(ctx, listGatewaysSQL)
	if err != nil {
		return nil, h.fail(ctx, "list gateways", err)
	}
	defer rows.Close()
	resp := &controlv1.ListGatewaysResponse{}
	for rows.Next() {
		var (
			g       controlv1.Gateway
			expires pgtype.Timestamptz
		)
		if err := rows.Scan(&g.Id, &g.LeaseEpoch, &expires, &g.Live, &g.Sessions); err != nil {
			return nil, h.fail(ctx, "list gateways", err)
		}
		g.LeaseExpiresAt = tsFinite(expires)
		resp.Gateways = append(resp.Gateways, &g)
	}
	if err := rows.Err(); err != nil {
		return nil, h.fail(ctx, "list gateways", err)
	}
	return connect.NewResponse(resp), nil
}
