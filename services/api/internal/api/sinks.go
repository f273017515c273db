package api

import (
	"context"
	"errors"
	"fmt"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/pkg/egress"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/pgdb"
)

// CreateSink creates a webhook sink. Its secret is stored for signing and
// never returned (Sink.has_secret says it is set); the worker delivers the
// sink under the lease singleton:sink:<id>.
func (h *Handler) CreateSink(ctx context.Context, req *connect.Request[controlv1.CreateSinkRequest]) (*connect.Response[controlv1.CreateSinkResponse], error) {
	m := req.Msg
	if err := checkRE("sink_id", m.GetSinkId(), sinkIDRE); err != nil {
		return nil, err
	}
	if m.GetKind() != controlv1.SinkKind_SINK_KIND_WEBHOOK {
		return nil, invalid("kind", "must be SINK_KIND_WEBHOOK")
	}
	if err := checkSinkURL("url", m.GetUrl(), h.sinkEgress); err != nil {
		return nil, err
	}
	// The secret's own characters are never echoed in an error.
	if err := checkSinkSecret("secret", m.GetSecret()); err != nil {
		return nil, err
	}
	var sink *controlv1.Sink
	err := pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error {
		var err error
		sink, err = scanSink(tx.QueryRow(ctx, insertSinkSQL, m.GetSinkId(), "webhook", m.GetUrl(), m.GetSecret()))
		if errors.Is(err, pgx.ErrNoRows) {
			return connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("sink_id: sink %q already exists", m.GetSinkId()))
		}
		if err != nil {
			return err
		}
		// The audit trail keeps the URL's scheme and host only: its
		// userinfo, path and query may carry the receiver's credentials.
		return h.recordAudit(ctx, tx, auditEvent{Method: "CreateSink", TargetKind: "sink", TargetID: sink.GetId(),
			Detail: map[string]any{"url": egress.RedactURL(m.GetUrl())}})
	})
	if err != nil {
		return nil, h.fail(ctx, "create sink", err)
	}
	return connect.NewResponse(&controlv1.CreateSinkResponse{Sink: sink}), nil
}

// ListSinks returns every sink, ordered by id, without secrets.
func (h *Handler) ListSinks(ctx context.Context, _ *connect.Request[controlv1.ListSinksRequest]) (*connect.Response[controlv1.ListSinksResponse], error) {
	rows, err := h.db.Query(ctx, listSinksSQL)
	if err != nil {
		return nil, h.fail(ctx, "list sinks", err)
	}
	defer rows.Close()
	resp := &controlv1.ListSinksResponse{}
	for rows.Next() {
		s, err := scanSink(rows)
		if err != nil {
			return nil, h.fail(ctx, "list sinks", err)
		}
		resp.Sinks = append(resp.Sinks, s)
	}
	if err := rows.Err(); err != nil {
		return nil, h.fail(ctx, "list sinks", err)
	}
	return connect.NewResponse(resp), nil
}

// DeleteSink deletes a sink and its delivery cursor.
func (h *Handler) DeleteSink(ctx context.Context, req *connect.Request[controlv1.DeleteSinkRequest]) (*connect.Response[controlv1.DeleteSinkResponse], error) {
	id := req.Msg.GetSinkId()
	if err := checkRE("sink_id", id, sinkIDRE); err != nil {
		return nil, err
	}
	err := pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error {
		var n int64
		if err := tx.QueryRow(ctx, deleteSinkSQL, id).Scan(&n); err != nil {
			return err
		}
		if n == 0 {
			return notFound("sink_id", "sink", id)
		}
		return h.recordAudit(ctx, tx, auditEvent{Method: "DeleteSink", TargetKind: "sink", TargetID: id})
	})
	if err != nil {
		return nil, h.fail(ctx, "delete sink", err)
	}
	return connect.NewResponse(&controlv1.DeleteSinkResponse{}), nil
}
