package coord_test

import (
	"context"
	"testing"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestStopWaitsForTheHeartbeatInFlight: a member stopped while its
// heartbeat is still queued on the server leaves the workers table for
// good. The pause is injected on the server: a trigger on workers that
// waits for an advisory lock the test holds stops the member's heartbeat
// before it touches its row (a DELETE does not fire it, so the Leave is not
// held). The member's client gives up on a cancelled statement without a
// cancel request (what a cancel that lands before the backend reads the
// statement amounts to under load). A stop that cancelled the pass left at
// once, with the heartbeat still queued behind it on the server; the stop
// now waits for the pass (bounded by its own timeout), so the Leave is
// ordered after the heartbeat and the row stays gone.
func TestStopWaitsForTheHeartbeatInFlight(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	if db.DirectURL == "" {
		t.Skip("needs a direct connection: a session's advisory lock does not survive a transaction pooler")
	}
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `
CREATE FUNCTION test_hold_heartbeat() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.id = 'wpaused' THEN
    PERFORM pg_advisory_lock(4242);
    PERFORM pg_advisory_unlock(4242);
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER test_hold_heartbeat BEFORE INSERT OR UPDATE ON workers
  FOR EACH ROW EXECUTE FUNCTION test_hold_heartbeat();`)
	require.NoError(t, err)

	cfg, err := pgxpool.ParseConfig(db.DirectURL)
	require.NoError(t, err)
	cfg.ConnConfig.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.DeadlineContextWatcherHandler{Conn: c.Conn()}
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	c, err := coord.NewClient(pool, "wpaused")
	require.NoError(t, err)
	// A TTL long enough that the held heartbeat is not given up by its
	// pass's own bound (a third of the TTL) while the test watches the stop.
	slow := coord.Timings{LeaseTTL: 30 * time.Second, Renew: 10 * time.Second, LiveWindow: time.Minute, ForgetAfter: 2 * time.Minute}
	r, err := coord.NewRenewer(coord.RenewerConfig{Groups: []coord.Group{coord.Controllers}, Timings: slow}, c, nil, prometheus.NewRegistry(), nil)
	require.NoError(t, err)
	require.NoError(t, services.StartAndAwaitRunning(ctx, r))
	require.Eventually(t, func() bool { return len(r.Shards(coord.Controllers)) == coord.NumShards }, 15*time.Second, 20*time.Millisecond)

	// Hold the next heartbeat on the server.
	lock, err := pgx.Connect(ctx, db.DirectURL)
	require.NoError(t, err)
	defer func() { _ = lock.Close(ctx) }()
	_, err = lock.Exec(ctx, `SELECT pg_advisory_lock(4242)`)
	require.NoError(t, err)
	r.Trigger("test")
	require.Eventually(t, func() bool {
		var waiting int
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND wait_event = 'advisory' AND query LIKE '%INSERT INTO workers%'`).Scan(&waiting)
		return waiting == 1
	}, 15*time.Second, 10*time.Millisecond, "the heartbeat waits on the server")

	r.StopAsync()
	// Give a stop that does not wait for the pass every chance to leave
	// before the heartbeat runs: until the member has terminated (it left
	// without waiting), or for a second (it waits for the pass, whose own
	// bound is ten seconds here).
	stopping := time.Now()
	for r.State() != services.Terminated && time.Since(stopping) < time.Second {
		time.Sleep(10 * time.Millisecond) // sampling the service's state
	}
	require.NotEqual(t, services.Terminated, r.State(), "the stop waits for the pass in flight, so its Leave comes after the heartbeat")
	var rows int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM workers WHERE id = 'wpaused'`).Scan(&rows))
	require.Equal(t, 1, rows, "no Leave while the heartbeat is in flight")
	_, err = lock.Exec(ctx, `SELECT pg_advisory_unlock(4242)`)
	require.NoError(t, err)
	require.NoError(t, r.AwaitTerminated(ctx))
	require.Eventually(t, func() bool {
		var active int
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%INSERT INTO workers%' AND state = 'active' AND pid <> pg_backend_pid()`).Scan(&active)
		return active == 0
	}, 15*time.Second, 10*time.Millisecond, "the held heartbeat has run")
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM workers WHERE id = 'wpaused'`).Scan(&rows))
	require.Zero(t, rows, "the stopped member left the workers table")
}
