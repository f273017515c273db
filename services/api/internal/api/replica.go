package api

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/leasehold/leasehold/pkg/pgdb"
)

// The read replica (--api.read-database-url) serves the paginated list
// RPCs; everything else reads and writes the primary. A list goes to the
// primary instead, for that call, when the replica is not known to be
// usable (its last probe failed, or a call to it failed since), when its
// replay lag is past --api.read-replica-max-lag, or when the call to it
// fails with a connection-class error: losing the replica never fails a
// list (docs/api.md, "Read replica").
const (
	// readProbeInterval is how often the replica's state and replay lag
	// are read.
	readProbeInterval = 2 * time.Second
	// readAttemptTimeout bounds a list's attempt on the replica: one that
	// hangs (a replica cut off without a reset) is retried on the primary.
	readAttemptTimeout = 5 * time.Second
	// readConnectTimeout bounds a dial of the replica.
	readConnectTimeout = 2 * time.Second
	// readLogEvery is the least time between two warnings of lists served
	// by the primary.
	readLogEvery = time.Minute
)

// Reasons a list went to the primary (label reason of
// leasehold_api_read_replica_fallbacks_total).
const (
	fallbackError       = "error"       // the call to the replica failed
	fallbackUnavailable = "unavailable" // the replica was known unusable: down, not a standby, never probed
	fallbackLag         = "lag"         // its replay lag was past the bound
)

// readProbeSQL reads whether the server is a standby and how far its replay
// is behind: 0 while its WAL receiver streams and it has replayed all it
// received, else the age of the last transaction it replayed (a standby
// that stopped receiving ages as the clock runs, even when the primary
// writes nothing). NULL when it has replayed no transaction since it
// started and is not caught up.
const readProbeSQL = `
SELECT pg_is_in_recovery(),
       CASE WHEN NOT pg_is_in_recovery() THEN NULL
            WHEN pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn() AND EXISTS (SELECT 1 FROM pg_stat_wal_receiver) THEN 0
            ELSE extract(epoch FROM clock_timestamp() - pg_last_xact_replay_timestamp())::float8 END`

// readPoolConfig is the replica's pool: read-only sessions (the
// default_transaction_read_only startup parameter, except behind a pooler,
// which refuses unknown startup parameters) and, on every new connection,
// pg_is_in_recovery() must be true (target_session_attrs=standby), so a
// promoted or mistaken server is never read as a replica.
func readPoolConfig(cfg Config, appName string, maxConns int32) (*pgxpool.Config, error) {
	const setting = "--api.read-database-url"
	pcfg, err := pgdb.PoolConfig(pgdb.Config{URL: cfg.ReadDatabaseURL, AppName: appName, MaxConns: maxConns,
		ConnectTimeout: readConnectTimeout, Pooler: cfg.ReadPooler, Setting: setting, ReadOnly: true})
	if err != nil {
		return nil, err
	}
	switch tsa := pgdb.TargetSessionAttrs(&pcfg.ConnConfig.Config); tsa {
	case "read-write", "primary":
		return nil, fmt.Errorf("%s: target_session_attrs=%s contradicts a read replica: leave it out (standby is implied)", setting, tsa)
	}
	pcfg.ConnConfig.ValidateConnect = pgconn.ValidateConnectTargetSessionAttrsStandby
	if !cfg.ReadPooler {
		pcfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	}
	// No connection is kept open for nothing: the probe dials when the
	// replica is back.
	pcfg.MinConns = 0
	return pcfg, nil
}

// readReplica is the replica's pool and what is known of it. Its methods
// are safe for concurrent use; the pool is set once, before serving.
type readReplica struct {
	pcfg       *pgxpool.Config
	pool       *pgxpool.Pool
	maxLag     time.Duration
	probeEvery time.Duration
	log        *slog.Logger

	// usable is true while lists may go to the replica: its last probe
	// succeeded on a standby and no call to it failed since.
	usable atomic.Bool
	// lag is the replica's replay lag of its last probe, in nanoseconds
	// (math.MaxInt64 when unknown).
	lag atomic.Int64

	fallbacks *prometheus.CounterVec
	lagGauge  prometheus.Gauge
	upGauge   prometheus.Gauge

	mu         sync.Mutex
	lastErr    string    // the last failure seen, for /healthz/detail
	lastLog    time.Time // when a fallback was last logged
	suppressed int       // fallbacks not logged since lastLog
	wasUp      bool      // the state last logged by a probe
	probed     bool      // a probe has logged its state
}

func newReadReplica(cfg Config, appName string, maxConns int32, reg prometheus.Registerer, log *slog.Logger) (*readReplica, error) {
	pcfg, err := readPoolConfig(cfg, appName, maxConns)
	if err != nil {
		return nil, err
	}
	r := &readReplica{pcfg: pcfg, maxLag: cfg.ReadReplicaMaxLag, probeEvery: cfg.readProbeInterval, log: log,
		fallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_api_read_replica_fallbacks_total",
			Help: "List calls served by the primary although --api.read-database-url is set, by reason: error (the call to the replica failed), unavailable (the replica was down or not a standby), lag (its replay lag was past --api.read-replica-max-lag).",
		}, []string{"reason"}),
		lagGauge: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "leasehold_api_read_replica_lag_seconds",
			Help: "Replay lag of the read replica at its last successful probe (0 while it streams and has replayed all it received).",
		}),
		upGauge: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "leasehold_api_read_replica_up",
			Help: "1 while list calls go to the read replica, 0 while they go to the primary.",
		}),
	}
	if r.probeEvery <= 0 {
		r.probeEvery = readProbeInterval
	}
	if r.maxLag <= 0 {
		r.maxLag = 5 * time.Second
	}
	r.lag.Store(math.MaxInt64)
	for _, reason := range []string{fallbackError, fallbackUnavailable, fallbackLag} {
		r.fallbacks.WithLabelValues(reason)
	}
	reg.MustRegister(r.fallbacks, r.lagGauge, r.upGauge)
	return r, nil
}

// open creates the pool; it dials nothing, so a replica that is down at
// start only keeps the lists on the primary until it is up.
func (r *readReplica) open(ctx context.Context) error {
	pool, err := pgxpool.NewWithConfig(context.WithoutCancel(ctx), r.pcfg)
	if err != nil {
		return fmt.Errorf("open --api.read-database-url pool: %w", err)
	}
	r.pool = pool
	return nil
}

func (r *readReplica) close() {
	if r.pool != nil {
		r.pool.Close()
	}
}

// route says why a list must go to the primary now, or "" when the replica
// may serve it.
func (r *readReplica) route() string {
	if !r.usable.Load() {
		return fallbackUnavailable
	}
	if time.Duration(r.lag.Load()) > r.maxLag {
		return fallbackLag
	}
	return ""
}

// readFault reports whether err, from a call to the replica, says the replica
// (not the request) is at fault: the primary answers the call instead.
// Besides lost and refused connections (a dial the standby check refused
// included) these are the errors a standby gives and a primary would not:
// a statement cancelled by a conflict with recovery, and a table, column
// or function a migration just added that the replica has not replayed.
func readFault(err error) bool {
	if pgdb.IsConnectionError(err) {
		return true
	}
	var ce *pgconn.ConnectError
	if errors.As(err, &ce) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "40001", "40P01", "57P04", "42P01", "42703", "42883":
			return true
		}
	}
	return false
}

// fellBack counts a list served by the primary and logs it, at most once
// per readLogEvery with the number of fallbacks left unlogged.
func (r *readReplica) fellBack(ctx context.Context, op, reason string, err error) {
	r.fallbacks.WithLabelValues(reason).Inc()
	r.mu.Lock()
	if err != nil {
		r.lastErr = err.Error()
	}
	now := time.Now()
	if now.Sub(r.lastLog) < readLogEvery {
		r.suppressed++
		r.mu.Unlock()
		return
	}
	suppressed, lastErr := r.suppressed, r.lastErr
	r.lastLog, r.suppressed = now, 0
	r.mu.Unlock()
	r.log.WarnContext(ctx, "list served by the primary: read replica not usable (logged at most once a minute)",
		"op", op, "reason", reason, "err", lastErr, "lag", time.Duration(r.lag.Load()).String(),
		"max_lag", r.maxLag.String(), "not_logged", suppressed)
}

// markDown keeps the lists on the primary until the next good probe.
func (r *readReplica) markDown() {
	r.usable.Store(false)
	r.upGauge.Set(0)
}

// run probes the replica every probeEvery until ctx ends, at once first.
func (r *readReplica) run(ctx context.Context) {
	t := time.NewTicker(r.probeEvery)
	defer t.Stop()
	for {
		r.probe(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// probe reads the replica's state and lag and sets whether lists may go
// to it. Transitions are logged.
func (r *readReplica) probe(ctx context.Context) {
	pctx, cancel := context.WithTimeout(ctx, min(r.probeEvery, readAttemptTimeout)+readConnectTimeout)
	defer cancel()
	var (
		recovery bool
		lag      *float64
	)
	err := r.pool.QueryRow(pctx, readProbeSQL).Scan(&recovery, &lag)
	if ctx.Err() != nil {
		return
	}
	switch {
	case err != nil:
		err = fmt.Errorf("probe --api.read-database-url: %w", err)
	case !recovery:
		err = errors.New("probe --api.read-database-url: pg_is_in_recovery() is false: the server is not a standby")
	}
	up := err == nil
	if lag != nil {
		l := time.Duration(*lag * float64(time.Second))
		r.lag.Store(int64(max(l, 0)))
		r.lagGauge.Set(max(*lag, 0))
	} else {
		r.lag.Store(math.MaxInt64)
	}
	r.usable.Store(up)
	serving := up && r.route() == ""
	if serving {
		r.upGauge.Set(1)
	} else {
		r.upGauge.Set(0)
	}
	r.mu.Lock()
	if err != nil {
		r.lastErr = err.Error()
	}
	changed := serving != r.wasUp || !r.probed
	r.wasUp, r.probed = serving, true
	r.mu.Unlock()
	if !changed {
		return
	}
	if serving {
		r.log.InfoContext(ctx, "list calls served by the read replica", "lag", time.Duration(r.lag.Load()).String())
	} else {
		r.log.WarnContext(ctx, "list calls served by the primary until the read replica is usable again",
			"err", errString(err), "lag", lagString(lag), "max_lag", r.maxLag.String())
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

func lagString(lag *float64) string {
	if lag == nil {
		return "unknown"
	}
	return time.Duration(*lag * float64(time.Second)).String()
}

// detail is the replica's section of /healthz/detail.
func (r *readReplica) detail() map[string]any {
	r.mu.Lock()
	lastErr := r.lastErr
	r.mu.Unlock()
	lag := time.Duration(r.lag.Load())
	d := map[string]any{"serving_lists": r.usable.Load() && r.route() == "", "max_lag": r.maxLag.String(), "last_error": lastErr}
	if lag != math.MaxInt64 {
		d["lag"] = lag.String()
	}
	return d
}

// readList runs a list's read on the replica when it may serve it, else,
// or when the attempt fails through the replica's fault, on the primary.
// read must set the whole response from what it reads: a failed attempt
// may have filled part of it.
func (h *Handler) readList(ctx context.Context, op string, read func(context.Context, pgdb.Querier) error) error {
	r := h.reads
	if r == nil {
		return read(ctx, h.db)
	}
	if reason := r.route(); reason != "" {
		r.fellBack(ctx, op, reason, nil)
		return read(ctx, h.db)
	}
	actx, cancel := context.WithTimeout(ctx, readAttemptTimeout)
	err := read(actx, r.pool)
	cancel()
	if err == nil || ctx.Err() != nil || (actx.Err() == nil && !readFault(err)) {
		return err
	}
	r.markDown()
	r.fellBack(ctx, op, fallbackError, err)
	return read(ctx, h.db)
}
