package reconcile_test

import (
	"context"
	"testing"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/queue"
	"github.com/leasehold/leasehold/pkg/reconcile"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func fastConfig() reconcile.Config {
	cfg := reconcile.DefaultConfig()
	cfg.Timings = coord.Timings{LeaseTTL: 3 * time.Second, Renew: time.Second, LiveWindow: 6 * time.Second, ForgetAfter: time.Minute}
	cfg.Poll = 50 * time.Millisecond
	cfg.SelfReleaseAfter = 2 * time.Second
	cfg.Backoff = queue.Backoff{Base: 50 * time.Millisecond, Max: 200 * time.Millisecond}
	return cfg
}

func newRuntime(t *testing.T, db *pgtest.DB, owner string, register func(rt *reconcile.Runtime)) *reconcile.Runtime {
	t.Helper()
	rt, err := reconcile.New(fastConfig(), db.Pool, reconcile.Options{Owner: owner, NotifyURL: db.DirectURL, Registerer: prometheus.NewRegistry()})
	require.NoError(t, err)
	register(rt)
	require.NoError(t, services.StartAndAwaitRunning(context.Background(), rt))
	t.Cleanup(func() { _ = services.StopAndAwaitTerminated(context.Background(), rt) })
	return rt
}

func exec(t *testing.T, db *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	_, err := db.Exec(context.Background(), sql, args...)
	require.NoError(t, err)
}

func count(t *testing.T, db *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}
