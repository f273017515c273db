package api

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/leasehold/leasehold/pkg/coord"
)

// Admission under overload (docs/api.md, "Overload"): each gateway
// publishes whether it is behind its work (gateway_load, written by the
// gateway under its lease); the api reads the overloaded ones, and the
// nodes whose sessions they hold, every overloadPoll and refuses
// CreateCommand for those nodes with RESOURCE_EXHAUSTED, nothing written.
// A refusal costs the database nothing: it is decided from what the last
// read found, so turning callers away does not take from the database
// the capacity the gateways are short of. What the gateways already hold drains
// at their full rate meanwhile, so completions stay at the maximum and the
// backlog, and with it create-to-done, stays bounded instead of growing
// for as long as the overload lasts.

// overloadPoll is how often the api reads the gateways' overload: often
// enough that a gateway that drained its backlog is fed again before it
// runs dry; overloadReadTimeout bounds one read.
const (
	overloadPoll        = 250 * time.Millisecond
	overloadReadTimeout = time.Second
)

// overloadedSQL lists the gateways that report overload and still hold
// their lease at the epoch they wrote the row under (a dead gateway's row,
// or one a restarted gateway has not yet rewritten, is ignored), with
// their lag.
var overloadedSQL = `
SELECT l.gateway_id, l.lag_ms FROM gateway_load l
 WHERE l.overloaded AND ` + coord.GatewayLeaseLiveAt("l.gateway_id", "l.lease_epoch")

// overloadedNodesSQL lists the nodes whose session an overloaded gateway
// holds; read only while some gateway reports overload.
const overloadedNodesSQL = `
SELECT node_id, gateway_id FROM node_sessions WHERE state = 'connected' AND gateway_id = ANY($1::text[])`

// overloaded is one read: the overloaded gateways' lags and their nodes.
type overloaded struct {
	lags  map[string]int32  // gateway id -> lag in ms
	nodes map[string]string // node id -> its overloaded gateway
}

// overloadWatch holds the overloaded gateways as last read.
type overloadWatch struct {
	// mu orders reads: a read's set replaces an earlier read's, never
	// the other way round.
	mu      sync.Mutex
	db      *pgxpool.Pool
	log     *slog.Logger
	last    atomic.Pointer[overloaded] // nil: not read yet
	gauge   prometheus.Gauge
	refused prometheus.Counter
}

func newOverloadWatch(db *pgxpool.Pool, reg prometheus.Registerer, log *slog.Logger) *overloadWatch {
	w := &overloadWatch{db: db, log: log,
		gauge: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "leasehold_api_overloaded_gateways", Help: "Gateways reporting overload at the last read (CreateCommand refuses their nodes' commands).",
		}),
		refused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_api_commands_refused_overload_total", Help: "CreateCommand calls refused because the node's gateway reported overload.",
		}),
	}
	if reg != nil {
		reg.MustRegister(w.gauge, w.refused)
	}
	return w
}

// run reads the gateways' overload every overloadPoll until ctx ends.
func (w *overloadWatch) run(ctx context.Context) {
	t := time.NewTicker(overloadPoll)
	defer t.Stop()
	for {
		w.read(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// read replaces the set. A failed read empties it: admission fails open,
// and a database that cannot answer this cannot take commands either.
func (w *overloadWatch) read(ctx context.Context) {
	w.mu.Lock()
	defer w.mu.Unlock()
	rctx, cancel := context.WithTimeout(ctx, overloadReadTimeout)
	defer cancel()
	o, err := readOverloaded(rctx, w.db)
	if err != nil {
		if ctx.Err() == nil {
			w.log.Debug("read gateway overload", "err", err)
		}
		o = &overloaded{}
	}
	before := w.last.Swap(o)
	if before != nil && len(before.lags) != len(o.lags) {
		w.log.Info("gateways reporting overload", "count", len(o.lags), "nodes", len(o.nodes))
	}
	w.gauge.Set(float64(len(o.lags)))
}

func readOverloaded(ctx context.Context, db *pgxpool.Pool) (*overloaded, error) {
	o := &overloaded{lags: map[string]int32{}, nodes: map[string]string{}}
	rows, err := db.Query(ctx, overloadedSQL)
	if err != nil {
		return nil, err
	}
	var (
		id, node string
		lag      int32
	)
	if _, err := pgx.ForEachRow(rows, []any{&id, &lag}, func() error { o.lags[id] = lag; return nil }); err != nil {
		return nil, err
	}
	if len(o.lags) == 0 {
		return o, nil
	}
	rows, err = db.Query(ctx, overloadedNodesSQL, slices.Collect(maps.Keys(o.lags)))
	if err != nil {
		return nil, err
	}
	if _, err := pgx.ForEachRow(rows, []any{&node, &id}, func() error { o.nodes[node] = id; return nil }); err != nil {
		return nil, err
	}
	return o, nil
}

// refusal is the RESOURCE_EXHAUSTED a new command for nodeID gets while
// the gateway holding its session reports overload, else nil.
func (w *overloadWatch) refusal(nodeID string) *connect.Error {
	o := w.last.Load()
	if o == nil {
		return nil
	}
	gw, ok := o.nodes[nodeID]
	if !ok {
		return nil
	}
	w.refused.Inc()
	lag := time.Duration(o.lags[gw]) * time.Millisecond
	err := connect.NewError(connect.CodeResourceExhausted, fmt.Errorf(
		"node_id: node %q is served by gateway %q, which is overloaded (commands wait %s for it); retry in a few seconds",
		nodeID, gw, lag))
	err.Meta().Set("Retry-After", strconv.Itoa(overloadRetryAfter(lag)))
	return err
}

// overloadRetryAfter is the Retry-After, in whole seconds, of a refusal
// for a gateway whose commands wait lag: that wait, at least one second
// and at most ten, so a client that honours it comes back about when
// what is queued ahead of it has gone.
func overloadRetryAfter(lag time.Duration) int {
	return int(min(max(math.Ceil(lag.Seconds()), 1), 10))
}
