package coord_test

import (
	"context"
	"testing"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/jonboulle/clockwork"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// testTime is a process clock and a database clock that move together: the
// test's database reads compute_now() from a row the test sets, so the
// database's view of time is the fake clock's. Set moves the database first
// and then the fake clock: a timer that fires on the advance finds the
// database already there.
type testTime struct {
	t     *testing.T
	db    *pgtest.DB
	clock *clockwork.FakeClock
}

func newTestTime(t *testing.T, db *pgtest.DB) *testTime {
	t.Helper()
	// Whole seconds, no monotonic reading: the database keeps microseconds.
	clock := clockwork.NewFakeClockAt(time.Now().UTC().Truncate(time.Second))
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, "CREATE TABLE test_now (at timestamptz NOT NULL)")
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, "INSERT INTO test_now VALUES ($1)", clock.Now())
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, "CREATE OR REPLACE FUNCTION compute_now() RETURNS timestamptz LANGUAGE sql VOLATILE AS $$ SELECT at FROM test_now $$")
	require.NoError(t, err)
	return &testTime{t: t, db: db, clock: clock}
}

// Advance moves both clocks forward by d.
func (tt *testTime) Advance(d time.Duration) {
	tt.t.Helper()
	_, err := tt.db.Pool.Exec(context.Background(), "UPDATE test_now SET at = $1", tt.clock.Now().Add(d))
	require.NoError(tt.t, err)
	tt.clock.Advance(d)
}

// passes reads leasehold_membership_passes_total{trigger} from reg.
func passes(t *testing.T, reg *prometheus.Registry, trigger string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "leasehold_membership_passes_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "trigger" && l.GetValue() == trigger {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// TestOrphanTakeoverIsAimedAtTheLeaseExpiry is about logic, on an injected
// clock with the database clock moved alongside it: a member that went
// silent still holds its shards until their leases expire. The survivor's
// pass that finds them held schedules its next attempt at that expiry, so
// the takeover happens at the first tick after it, not at the next renewal
// period.
func TestOrphanTakeoverIsAimedAtTheLeaseExpiry(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	tt := newTestTime(t, db)
	ctx := context.Background()
	// Renew is long against the tick (1 s): the next period after the
	// survivor's first pass is 9 s away, the orphans' expiry 3 s.
	timings := coord.Timings{LeaseTTL: 20 * time.Second, Renew: 9 * time.Second, LiveWindow: time.Minute, ForgetAfter: 10 * time.Minute}
	g := coord.Controllers
	owners := coord.Assign([]string{g.RowID("wa"), g.RowID("wb")})
	var mine, orphans []string
	for s, o := range owners {
		if o == g.RowID("wb") {
			orphans = append(orphans, g.ShardLease(s))
		} else {
			mine = append(mine, g.ShardLease(s))
		}
	}
	require.NotEmpty(t, orphans)
	require.NotEmpty(t, mine)

	// wb heartbeats and takes its shards for 28 s, then dies: no further
	// heartbeat, no release.
	start := tt.clock.Now()
	_, err := coord.Heartbeat(ctx, db.Pool, g, g.RowID("wb"), coord.HeartbeatInfo{ProcessID: "wb"}, timings)
	require.NoError(t, err)
	wb, err := coord.NewClient(db.Pool, "wb", coord.WithClock(tt.clock))
	require.NoError(t, err)
	grant, err := wb.AcquireMany(ctx, orphans, 28*time.Second)
	require.NoError(t, err)
	require.Len(t, grant.Leases, len(orphans))
	expiry := start.Add(28 * time.Second)

	// 25 s on, wb is silent (quiet for more than a TTL) but still live, and
	// its leases have 3 s left: wa's first pass takes only its own shards.
	tt.Advance(25 * time.Second)
	wa, err := coord.NewClient(db.Pool, "wa", coord.WithClock(tt.clock))
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	r, err := coord.NewRenewer(coord.RenewerConfig{Groups: []coord.Group{g}, Timings: timings}, wa, nil, reg, tt.clock)
	require.NoError(t, err)
	require.NoError(t, services.StartAndAwaitRunning(ctx, r))
	t.Cleanup(func() { _ = services.StopAndAwaitTerminated(context.Background(), r) })
	require.Eventually(t, func() bool { return r.Ready() == nil }, 10*time.Second, 5*time.Millisecond, "the first pass completes")
	require.Len(t, r.Shards(g), len(mine), "the orphans are still held by the silent member")
	firstPass := tt.clock.Now()
	require.NoError(t, tt.clock.BlockUntilContext(ctx, 1)) // the renewal ticker

	// One second past the expiry and well before the next period: the pass
	// aimed at the expiry takes the orphans.
	tt.Advance(expiry.Add(time.Second).Sub(tt.clock.Now()))
	require.Less(t, tt.clock.Now(), firstPass.Add(timings.Renew), "the next renewal period has not come")
	require.Eventually(t, func() bool { return len(r.Shards(g)) == coord.NumShards }, 10*time.Second, 5*time.Millisecond,
		"the survivor takes the orphans at their expiry, not at its next period")
	require.Equal(t, 1.0, passes(t, reg, "orphan-expiry"), "one pass, scheduled at the expiry")
	require.Zero(t, passes(t, reg, "period"), "no periodic pass has run")
	l, ok := r.Lease(orphans[0])
	require.True(t, ok)
	require.Equal(t, expiry.Add(time.Second), l.GrantedAt.UTC(), "taken on the database at the first tick after expiry")
	prev, _ := grant.Get(orphans[0])
	require.Greater(t, l.Epoch, prev.Epoch, "a new holder, a new epoch")
}
