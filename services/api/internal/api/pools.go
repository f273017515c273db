package api

import (
	"context"
	"errors"
	"fmt"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/queue"
)

// PlacerReconciler is the work-queue reconciler of the scheduler's
// pool-lease placer; its keys are pool ids.
const PlacerReconciler = "pool-placer"

// CreatePool creates a pool.
func (h *Handler) CreatePool(ctx context.Context, req *connect.Request[controlv1.CreatePoolRequest]) (*connect.Response[controlv1.CreatePoolResponse], error) {
	m := req.Msg
	if err := checkRE("pool_id", m.GetPoolId(), idRE); err != nil {
		return nil, err
	}
	if err := checkText("description", m.GetDescription(), maxDescription); err != nil {
		return nil, err
	}
	if err := checkLabels("labels", m.GetLabels()); err != nil {
		return nil, err
	}
	var pool *controlv1.Pool
	err := pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, insertPoolSQL, m.GetPoolId(), m.GetDescription(), encodeLabels(m.GetLabels())).Scan(new(string)); errors.Is(err, pgx.ErrNoRows) {
			return connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("pool_id: pool %q already exists", m.GetPoolId()))
		} else if err != nil {
			return err
		}
		var err error
		if pool, err = scanPool(tx.QueryRow(ctx, getPoolSQL, m.GetPoolId())); err != nil {
			return err
		}
		return h.recordAudit(ctx, tx, auditEvent{Method: "CreatePool", TargetKind: "pool", TargetID: pool.GetId()})
	})
	if err != nil {
		return nil, h.fail(ctx, "create pool", err)
	}
	return connect.NewResponse(&controlv1.CreatePoolResponse{Pool: pool}), nil
}

// GetPool returns one pool.
func (h *Handler) GetPool(ctx context.Context, req *connect.Request[controlv1.GetPoolRequest]) (*connect.Response[controlv1.GetPoolResponse], error) {
	id := req.Msg.GetPoolId()
	if err := checkRE("pool_id", id, idRE); err != nil {
		return nil, err
	}
	pool, err := scanPool(h.db.QueryRow(ctx, getPoolSQL, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, notFound("pool_id", "pool", id)
	}
	if err != nil {
		return nil, h.fail(ctx, "get pool", err)
	}
	return connect.NewResponse(&controlv1.GetPoolResponse{Pool: pool}), nil
}

// ListPools returns pools ordered by id.
func (h *Handler) ListPools(ctx context.Context, req *connect.Request[controlv1.ListPoolsRequest]) (*connect.Response[controlv1.ListPoolsResponse], error) {
	const method = "ListPools"
	m := req.Msg
	if err := checkPage(m.GetPageSize(), m.GetPageToken()); err != nil {
		return nil, err
	}
	p, err := openPage(method, m.GetPageSize(), m.GetPageToken())
	if err != nil {
		return nil, err
	}
	resp := &controlv1.ListPoolsResponse{}
	err = h.readList(ctx, "list pools", func(ctx context.Context, q pgdb.Querier) error {
		rows, err := q.Query(ctx, listPoolsSQL, p.after.ID, p.limit())
		if err != nil {
			return err
		}
		resp.Pools, resp.NextPageToken, err = collectPage(p, rows, func(r pgx.Rows) (*controlv1.Pool, pageKey, error) {
			pool, err := scanPool(r)
			return pool, pageKey{ID: pool.GetId()}, err
		})
		return err
	})
	if err != nil {
		return nil, h.fail(ctx, "list pools", err)
	}
	return connect.NewResponse(resp), nil
}

// CreatePoolLease records a pending pool lease and, in the same
// transaction, enqueues its pool for the scheduler's placer.
func (h *Handler) CreatePoolLease(ctx context.Context, req *connect.Request[controlv1.CreatePoolLeaseRequest]) (*connect.Response[controlv1.CreatePoolLeaseResponse], error) {
	m := req.Msg
	if err := checkRE("pool_id", m.GetPoolId(), idRE); err != nil {
		return nil, err
	}
	if err := checkRE("tenant", m.GetTenant(), idRE); err != nil {
		return nil, err
	}
	if c := m.GetCount(); c < 1 || c > maxPoolLeaseCount {
		return nil, invalid("count", "must be in 1..%d, got %d", maxPoolLeaseCount, c)
	}
	if err := checkLabels("selector", m.GetSelector()); err != nil {
		return nil, err
	}
	var lease *controlv1.PoolLease
	err := pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, lockPoolSQL, m.GetPoolId()).Scan(new(int)); errors.Is(err, pgx.ErrNoRows) {
			return notFound("pool_id", "pool", m.GetPoolId())
		} else if err != nil {
			return err
		}
		var id string
		if err := tx.QueryRow(ctx, insertPoolLeaseSQL, m.GetPoolId(), m.GetTenant(), m.GetCount(), encodeLabels(m.GetSelector())).Scan(&id); err != nil {
			return err
		}
		if _, err := queue.Enqueue(ctx, tx, PlacerReconciler, m.GetPoolId(), 0); err != nil {
			return fmt.Errorf("enqueue pool %s: %w", m.GetPoolId(), err)
		}
		var err error
		if lease, _, err = scanPoolLease(tx.QueryRow(ctx, getPoolLeaseSQL, id)); err != nil {
			return err
		}
		return h.recordAudit(ctx, tx, auditEvent{Method: "CreatePoolLease", TargetKind: "pool_lease", TargetID: id,
			Detail: map[string]any{"pool_id": lease.GetPoolId(), "tenant": lease.GetTenant(), "count": lease.GetCount()}})
	})
	if err != nil {
		return nil, h.fail(ctx, "create pool lease", err)
	}
	return connect.NewResponse(&controlv1.CreatePoolLeaseResponse{PoolLease: lease}), nil
}

// GetPoolLease returns one pool lease and its allocations.
func (h *Handler) GetPoolLease(ctx context.Context, req *connect.Request[controlv1.GetPoolLeaseRequest]) (*connect.Response[controlv1.GetPoolLeaseResponse], error) {
	id := req.Msg.GetPoolLeaseId()
	if err := checkRE("pool_lease_id", id, idRE); err != nil {
		return nil, err
	}
	lease, _, err := scanPoolLease(h.db.QueryRow(ctx, getPoolLeaseSQL, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, notFound("pool_lease_id", "pool lease", id)
	}
	if err != nil {
		return nil, h.fail(ctx, "get pool lease", err)
	}
	return connect.NewResponse(&controlv1.GetPoolLeaseResponse{PoolLease: lease}), nil
}

// ListPoolLeases returns pool leases newest first.
func (h *Handler) ListPoolLeases(ctx context.Context, req *connect.Request[controlv1.ListPoolLeasesRequest]) (*connect.Response[controlv1.ListPoolLeasesResponse], error) {
	const method = "ListPoolLeases"
	m := req.Msg
	if err := checkPage(m.GetPageSize(), m.GetPageToken()); err != nil {
		return nil, err
	}
	if err := checkOptionalRE("pool_id", m.GetPoolId(), idRE); err != nil {
		return nil, err
	}
	if err := checkOptionalRE("tenant", m.GetTenant(), idRE); err != nil {
		return nil, err
	}
	if err := checkEnum("state", m.GetState(), controlv1.PoolLeaseState_name, true); err != nil {
		return nil, err
	}
	p, err := openPage(method, m.GetPageSize(), m.GetPageToken())
	if err != nil {
		return nil, err
	}
	resp := &controlv1.ListPoolLeasesResponse{}
	err = h.readList(ctx, "list pool leases", func(ctx context.Context, q pgdb.Querier) error {
		rows, err := q.Query(ctx, listPoolLeasesSQL, p.after.after(), p.after.ID, m.GetPoolId(), m.GetTenant(), dbName(poolLeaseStates, m.GetState()), p.limit())
		if err != nil {
			return err
		}
		resp.PoolLeases, resp.NextPageToken, err = collectPage(p, rows, func(r pgx.Rows) (*controlv1.PoolLease, pageKey, error) {
			l, created, err := scanPoolLease(r)
			return l, pageKey{ID: l.GetId(), At: created.UnixMicro()}, err
		})
		return err
	})
	if err != nil {
		return nil, h.fail(ctx, "list pool leases", err)
	}
	return connect.NewResponse(resp), nil
}

// ReleasePoolLease marks the lease released, frees its nodes and enqueues
// its pool for the placer, in one transaction. Releasing twice returns the
// released lease unchanged.
func (h *Handler) ReleasePoolLease(ctx context.Context, req *connect.Request[controlv1.ReleasePoolLeaseRequest]) (*connect.Response[controlv1.ReleasePoolLeaseResponse], error) {
	id := req.Msg.GetPoolLeaseId()
	if err := checkRE("pool_lease_id", id, idRE); err != nil {
		return nil, err
	}
	var lease *controlv1.PoolLease
	err := pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error {
		var pool, state string
		if err := tx.QueryRow(ctx, lockPoolLeaseSQL, id).Scan(&pool, &state); errors.Is(err, pgx.ErrNoRows) {
			return notFound("pool_lease_id", "pool lease", id)
		} else if err != nil {
			return err
		}
		if state != "released" {
			if _, err := tx.Exec(ctx, releasePoolLeaseSQL, id); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, deleteAllocationsSQL, id); err != nil {
				return err
			}
			if _, err := queue.Enqueue(ctx, tx, PlacerReconciler, pool, 0); err != nil {
				return fmt.Errorf("enqueue pool %s: %w", pool, err)
			}
		}
		var err error
		if lease, _, err = scanPoolLease(tx.QueryRow(ctx, getPoolLeaseSQL, id)); err != nil {
			return err
		}
		return h.recordAudit(ctx, tx, auditEvent{Method: "ReleasePoolLease", TargetKind: "pool_lease", TargetID: id,
			Outcome: outcome(state != "released"), Detail: map[string]any{"pool_id": pool}})
	})
	if err != nil {
		return nil, h.fail(ctx, "release pool lease", err)
	}
	return connect.NewResponse(&controlv1.ReleasePoolLeaseResponse{PoolLease: lease}), nil
}
