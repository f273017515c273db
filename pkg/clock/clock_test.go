package clock

import (
	"context"
	"testing"
	"time"

	"github.com/jonboulle/clockwork"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestScaledClockRunsRateTimesFaster(t *testing.T) {
	base := clockwork.NewFakeClockAt(time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC))
	epoch := base.Now()
	c := newScaled(Scale{Epoch: epoch, Rate: 5}, base)
	require.Equal(t, epoch, c.Now(), "both clocks agree at the epoch")

	timer := c.NewTimer(10 * time.Second) // simulated: 2 s of base time
	fired := make(chan struct{})
	c.AfterFunc(20*time.Second, func() { close(fired) })

	base.Advance(1999 * time.Millisecond)
	select {
	case <-timer.Chan():
		t.Fatal("a 10 s simulated timer fired before 2 s of base time")
	default:
	}
	base.Advance(time.Millisecond)
	<-timer.Chan()
	require.Equal(t, epoch.Add(10*time.Second), c.Now())
	require.Equal(t, 10*time.Second, c.Since(epoch))

	require.True(t, timer.Reset(5*time.Second) == false)
	base.Advance(time.Second) // 5 s simulated
	<-timer.Chan()
	base.Advance(time.Second) // AfterFunc at 20 s simulated = 4 s base
	<-fired
	require.Equal(t, 20*time.Second, c.Since(epoch))
}

func TestNewRefusesABadScale(t *testing.T) {
	for _, s := range []Scale{{Rate: 2}, {Epoch: time.Now(), Rate: 0.5}, {Epoch: time.Now(), Rate: 101}} {
		_, err := New(s)
		require.Error(t, err, "%+v", s)
	}
	c, err := New(Scale{})
	require.NoError(t, err)
	require.IsType(t, clockwork.NewRealClock(), c, "rate 0 is the real clock")
}

// TestInstallSQLScalesComputeNow checks the database and a process running
// New(s) agree on simulated time, and that UninstallSQL restores the
// server's clock.
func TestInstallSQLScalesComputeNow(t *testing.T) {
	db := pgtest.NewDB(t)
	ctx := context.Background()
	s := Scale{Epoch: time.Now().Add(-10 * time.Second), Rate: 10}
	require.NoError(t, InstallSQL(ctx, db.Pool, s))
	c, err := New(s)
	require.NoError(t, err)

	// Time read around the statement, not a duration assumed: a busy
	// machine only widens the interval.
	var dbNow, wall time.Time
	before := c.Now()
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT compute_now(), clock_timestamp()").Scan(&dbNow, &wall))
	after := c.Now()
	require.False(t, dbNow.Before(before.Add(-time.Second)) || dbNow.After(after.Add(time.Second)),
		"process and database agree on simulated time: database %s, process %s to %s", dbNow, before, after)
	want := s.Epoch.Add(time.Duration(float64(wall.Sub(s.Epoch)) * s.Rate)) // 90 s ahead 10 s after the epoch
	// (compute_now() reads clock_timestamp() again, a moment later: 1 s
	// simulated is 100 ms of wall time for the backend to be descheduled.)
	require.WithinDuration(t, want, dbNow, time.Second, "compute_now() runs at rate 10 from the epoch")

	// A lease taken for 15 simulated seconds expires (after 1.5 wall
	// seconds): wait for the database to say so.
	var expires time.Time
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT compute_now() + interval '15 seconds'").Scan(&expires))
	require.Eventually(t, func() bool {
		var expired bool
		err := db.Pool.QueryRow(ctx, "SELECT compute_now() > $1", expires).Scan(&expired)
		return err == nil && expired
	}, 30*time.Second, 20*time.Millisecond, "a 15 s lease at rate 10 expires")

	require.NoError(t, UninstallSQL(ctx, db.Pool))
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT compute_now(), clock_timestamp()").Scan(&dbNow, &wall))
	require.WithinDuration(t, wall, dbNow, time.Second)
}
