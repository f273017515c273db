package api

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/leasehold/leasehold/pkg/coord"
)

// Admission under overload (docs/api.md, "Overload"): each gateway
// publishes whether it is behind its work (gateway_load, written by the
// gateway under its lease); the api reads the overloaded ones every
// overloadPoll and refuses CreateCommand for their nodes with
// RESOURCE_EXHAUSTED, nothing written. What the gateways already hold drains
// at their full rate meanwhile, so completions stay at the maximum and the
// backlog, and with it create-to-done, stays bounded instead of growing
// for as long as the overload lasts.

// overloadPoll is how often the api reads the gateways' overload.
const overloadPoll = time.Second

// overloadedSQL lists the gateways that report overload and still hold
// their lease (a dead gateway's row is ignored), with their lag.
var overloadedSQL = `
SELECT l.gateway_id, l.lag_ms FROM gateway_load l
 WHERE l.overloaded AND ` + coord.GatewayLeaseLive("l.gateway_id")

// nodeGatewaySQL is the gateway holding a node's session, if any; read
// only while some gateway reports overload.
const nodeGatewaySQL = `SELECT gateway_id FROM node_sessions WHERE node_id = $1 AND state = 'connected'`

// overloadWatch holds the overloaded gateways as last read.
type overloadWatch struct {
	// mu orders reads: a read's set replaces an earlier read's, never
	// the other way round.
	mu      sync.Mutex
	db      *pgxpool.Pool
	log     *slog.Logger
	lags    atomic.Pointer[map[string]int32] // gateway id -> lag in ms; nil or empty: none
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
	rctx, cancel := context.WithTimeout(ctx, overloadPoll)
	defer cancel()
	lags := map[string]int32{}
	rows, err := w.db.Query(rctx, overloadedSQL)
	if err == nil {
		var (
			id  string
			lag int32
		)
		_, err = pgx.ForEachRow(rows, []any{&id, &lag}, func() error {
			lags[id] = lag
			return nil
		})
	}
	if err != nil && ctx.Err() == nil {
		w.log.Debug("read gateway overload", "err", err)
		lags = map[string]int32{}
	}
	before := w.lags.Swap(&lags)
	if before != nil && len(*before) != len(lags) {
		w.log.Info("gateways reporting overload", "count", len(lags))
	}
	w.gauge.Set(float64(len(lags)))
}

// lag says whether gatewayID reports overload, and its lag.
func (w *overloadWatch) lag(gatewayID string) (time.Duration, bool) {
	p := w.lags.Load()
	if p == nil {
		return 0, false
	}
	ms, ok := (*p)[gatewayID]
	return time.Duration(ms) * time.Millisecond, ok
}

// anyOverloaded is false when no gateway reports overload: CreateCommand
// then pays nothing for admission.
func (w *overloadWatch) anyOverloaded() bool {
	p := w.lags.Load()
	return p != nil && len(*p) > 0
}
