package process_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/jonboulle/clockwork"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/lifecycle"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/process"
	"github.com/leasehold/leasehold/pkg/proctest"
)

// TestGenericPlansKeepStatisticsFresh: a process whose pool plans
// generically analyzes a table that outgrew its statistics by itself; the
// signal is PostgreSQL's own count of analyzes of the table and the log
// line naming it. Autovacuum is off for the table, so only the process
// can have analyzed it.
func TestGenericPlansKeepStatisticsFresh(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `CREATE TABLE grown (id int PRIMARY KEY) WITH (autovacuum_enabled = false);
		INSERT INTO grown SELECT generate_series(1, 5000)`)
	require.NoError(t, err)
	logs, err := os.CreateTemp(t.TempDir(), "log")
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	spec := process.Spec{
		Name: "testsvc", HTTPAddr: "127.0.0.1:0", GenericPlans: true,
		Build: func(context.Context, *process.Process) ([]services.Service, error) {
			return []services.Service{services.NewIdleService(nil, nil)}, nil
		},
	}
	exit := make(chan int, 1)
	go func() {
		// Through PgBouncer the process is told so (--pooler), as a deployment
		// behind one is: it then leaves generic plans out.
		args := append([]string{"--database-url", db.URL, "--http-addr", "127.0.0.1:0"}, pgtest.PoolerFlags(db.URL)...)
		exit <- process.Run(ctx, spec, args, logs)
	}()
	// Polled on the database, which is the signal; a process that exits
	// instead fails the test at once with its log.
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	giveUp := time.NewTimer(time.Minute)
	defer giveUp.Stop()
	for analyzed := false; !analyzed; {
		select {
		case code := <-exit:
			out, _ := os.ReadFile(logs.Name())
			t.Fatalf("the process exited with status %d:\n%s", code, out)
		case <-giveUp.C:
			t.Fatal("the process never analyzed the grown table")
		case <-tick.C:
		}
		var n int64
		err := db.Pool.QueryRow(ctx, `SELECT analyze_count FROM pg_stat_user_tables WHERE relname = 'grown'`).Scan(&n)
		analyzed = err == nil && n > 0
	}
	cancel()
	require.Equal(t, 0, <-exit)
	out, err := os.ReadFile(logs.Name())
	require.NoError(t, err)
	require.Contains(t, string(out), `"table":"grown"`)
}

// TestPlanStatsPassesOnTheProcessClock is about logic, on an injected
// clock: the plan-statistics component looks for stale tables at each tick
// of its period on the process clock, not before. Its log lines carry the
// fake clock's time, so the line naming the table says when the pass ran.
func TestPlanStatsPassesOnTheProcessClock(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `CREATE TABLE grown (id int PRIMARY KEY) WITH (autovacuum_enabled = false);
		INSERT INTO grown SELECT generate_series(1, 5000)`)
	require.NoError(t, err)
	// The live-row count comes from PostgreSQL's statistics system, which
	// publishes a session's counts a moment after its transaction: wait for
	// it, so the first pass has a stale table to find.
	require.Eventually(t, func() bool {
		var n int64
		err := db.Pool.QueryRow(ctx, `SELECT n_live_tup FROM pg_stat_user_tables WHERE relname = 'grown'`).Scan(&n)
		return err == nil && n == 5000
	}, 30*time.Second, 20*time.Millisecond, "the statistics system counted the rows")

	clock := clockwork.NewFakeClock()
	var logs proctest.Buffer
	logger := slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
		if a.Key == slog.TimeKey {
			return slog.Time(slog.TimeKey, clock.Now())
		}
		return a
	}}))
	p := &process.Process{Process: &lifecycle.Process{Name: "testsvc", Logger: logger, Clock: clock}, DB: db.Pool}
	svc := process.NewPlanStats(p)
	require.NoError(t, services.StartAndAwaitRunning(ctx, svc))
	t.Cleanup(func() { require.NoError(t, services.StopAndAwaitTerminated(context.Background(), svc)) })
	bctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, clock.BlockUntilContext(bctx, 1), "the component's ticker")
	start := clock.Now()

	clock.Advance(process.PlanStatsEvery - time.Millisecond)
	clock.Advance(time.Millisecond)
	var line string
	require.Eventually(t, func() bool {
		for _, l := range strings.Split(logs.String(), "\n") {
			if strings.Contains(l, `"table":"grown"`) {
				line = l
				return true
			}
		}
		return false
	}, 10*time.Second, 5*time.Millisecond, "the pass at the first tick analyzed the grown table")
	var rec struct {
		Time        time.Time `json:"time"`
		PlannedRows int64     `json:"planned_rows"`
		LiveRows    int64     `json:"live_rows"`
	}
	require.NoError(t, json.Unmarshal([]byte(line), &rec))
	require.True(t, rec.Time.Equal(start.Add(process.PlanStatsEvery)), "the pass ran at the first tick (%s after the start), not before", rec.Time.Sub(start))
	require.EqualValues(t, 5000, rec.LiveRows)
	var reltuples float64
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT reltuples FROM pg_class WHERE relname = 'grown'`).Scan(&reltuples))
	require.EqualValues(t, 5000, reltuples, "ANALYZE gave the planner the table's size")
}
