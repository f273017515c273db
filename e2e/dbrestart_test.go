package e2e

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/fleettest"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// restartGateway are gateway timings for the database-restart test: a 10 s
// lease renewed every second, so the gateway fences itself only after 5 s
// without a renewal — longer than a restart of the test cluster takes. (An
// outage longer than TTL/2 makes a gateway fence itself and exit on purpose:
// its supervisor restarts it.)
var restartGateway = append(slices.Clone(fleettest.FastGateway),
	"--gateway.lease-ttl", "10s", "--gateway.lease-renew", "1s", "--gateway.session-lease", "20s",
	"--gateway.liveness-interval", "500ms")

// restartCoord are worker timings: TTL 6 s, renew 1 s, self-release after
// 8 s of stalled renewal (longer than the outage).
var restartCoord = append(slices.Clone(fleettest.FastCoord),
	"--coord.lease-ttl", "6s", "--coord.live-window", "12s", "--coord.self-release-after", "8s")

// TestDatabaseRestartUnderLoad restarts PostgreSQL twice — pg_ctl's fast
// mode, then immediate mode (a crash: recovery from WAL) — while two
// gateways, two workers and 20 node daemons run and commands are inserted
// every 20 ms. Every service must recover in-process (none exits, all ready
// again), no command or result acknowledged before a restart may be lost,
// every command created executes exactly once on its node, and no lease's
// epoch goes backwards (a change of owner bumps it). It logs the time to
// recovery: from the start of the restart to the first renewal of each
// lease holder and to the first result accepted afterwards.
func TestDatabaseRestartUnderLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes and a database restart")
	}
	// Restarting the server hits every database of this binary: e2e tests
	// do not run in parallel.
	srv := pgtest.Server(t)
	db := pgtest.NewDB(t)
	ctx := context.Background()
	// The test cluster runs with synchronous_commit off for speed, which
	// loses the last commits of an immediate shutdown (a crash) even though
	// they were acknowledged: exactly what leasehold must not be blamed for.
	// Every session of this database commits synchronously; the test's own
	// inserts also say so per transaction (sessions opened before this).
	_, err := db.Pool.Exec(ctx, `ALTER DATABASE `+pgx.Identifier{db.Name}.Sanitize()+` SET synchronous_commit = on`)
	require.NoError(t, err)

	g1 := fleettest.StartGateway(t, db.URL, "gw_r1", restartGateway...)
	g2 := fleettest.StartGateway(t, db.URL, "gw_r2", restartGateway...)
	w1 := fleettest.StartService(t, "worker", db.URL, "wr1", restartCoord...)
	w2 := fleettest.StartService(t, "worker", db.URL, "wr2", restartCoord...)
	procs := map[string]interface {
		Exited() bool
		WaitReady(time.Duration)
		Logs() string
	}{"gw_r1": g1, "gw_r2": g2, "wr1": w1, "wr2": w2}
	lb := balancer(t, g1.Listen, g2.Listen)

	ids, creds := fleettest.RegisterNodes(t, db.Pool, "rnode", 20)
	nodes := startNodes(t, lb.URL(), ids, creds)
	require.Eventually(t, func() bool {
		n, err := queryInt(db.Pool, `SELECT count(*) FROM node_sessions WHERE state = 'connected'`)
		return err == nil && n == len(ids)
	}, 30*time.Second, 50*time.Millisecond)
	load := startLoad(t, db.Pool, "rcmd", ids, 20*time.Millisecond)

	for _, immediate := range []bool{false, true} {
		mode := map[bool]string{false: "fast", true: "immediate"}[immediate]
		// Let results accumulate, then snapshot what is acknowledged.
		require.Eventually(t, func() bool {
			n, err := queryInt(db.Pool, `SELECT count(*) FROM command_results_all`)
			return err == nil && n >= 50
		}, 30*time.Second, 50*time.Millisecond)
		results := map[string]string{}
		require.NoError(t, pgxRetry(func() error {
			rows, err := db.Pool.Query(ctx, `SELECT r.command_id, r.id FROM command_results_all r JOIN commands c ON c.id = r.command_id WHERE c.state = 'succeeded'`)
			if err != nil {
				return err
			}
			defer rows.Close()
			for rows.Next() {
				var cid, rid string
				if err := rows.Scan(&cid, &rid); err != nil {
					return err
				}
				results[cid] = rid
			}
			return rows.Err()
		}))
		before := readLeases(t, db.Pool)
		resultsBefore := len(results)

		var dbStart time.Time
		require.NoError(t, pgxRetry(func() error { return db.Pool.QueryRow(ctx, `SELECT compute_now()`).Scan(&dbStart) }))
		start := time.Now()
		srv.Restart(t, immediate)
		up := time.Since(start)

		// Time to recovery, on the database clock from the start of the
		// restart: each holder's first renewal (expires_at - TTL after the
		// start) and the first result accepted once the server was back.
		ttl := func(name string) time.Duration {
			if strings.HasPrefix(name, "gateway:") {
				return 10 * time.Second
			}
			return 6 * time.Second
		}
		renewed := map[string]time.Duration{}
		var firstResult time.Duration
		deadline := time.Now().Add(30 * time.Second)
		for time.Now().Before(deadline) && (len(renewed) < 4 || firstResult == 0) {
			if firstResult == 0 {
				var first *time.Time
				if err := db.Pool.QueryRow(ctx, `SELECT min(received_at) FROM command_results_all WHERE received_at > $1`, dbStart.Add(up)).Scan(&first); err == nil && first != nil {
					firstResult = first.Sub(dbStart)
				}
			}
			if rows, err := db.Pool.Query(ctx, `SELECT name, owner, expires_at FROM leases WHERE owner IS NOT NULL`); err == nil {
				for rows.Next() {
					var name, owner string
					var exp time.Time
					if rows.Scan(&name, &owner, &exp) != nil {
						continue
					}
					if at := exp.Add(-ttl(name)).Sub(dbStart); at > 0 {
						if d, ok := renewed[owner]; !ok || at < d {
							renewed[owner] = at
						}
					}
				}
				rows.Close()
			}
			time.Sleep(20 * time.Millisecond) // sampling interval while the restart (the fault) runs
		}
		t.Logf("%s restart: server back after %s; first renewal after the restart began: %v; first accepted result: %s",
			mode, up.Round(time.Millisecond), roundAll(renewed), firstResult.Round(time.Millisecond))
		require.Len(t, renewed, 4, "every lease holder renews again without a process restart: %v", renewed)
		require.NotZero(t, firstResult, "results are accepted again")

		// Nothing acknowledged before the restart is lost.
		require.NoError(t, pgxRetry(func() error {
			for cid, rid := range results {
				var state, got string
				if err := db.Pool.QueryRow(ctx, `SELECT c.state, r.id FROM commands c JOIN command_results_all r ON r.command_id = c.id WHERE c.id = $1`, cid).Scan(&state, &got); err != nil {
					return err
				}
				require.Equal(t, "succeeded", state, "command %s", cid)
				require.Equal(t, rid, got, "result of %s", cid)
			}
			return nil
		}))
		// Epochs never go backwards; a change of owner bumps the epoch.
		after := readLeases(t, db.Pool)
		for name, b := range before {
			a, ok := after[name]
			require.True(t, ok, "lease %s disappeared", name)
			require.GreaterOrEqual(t, a.epoch, b.epoch, "epoch of %s went backwards", name)
			if a.owner != "" && b.owner != "" && a.owner != b.owner {
				require.Greater(t, a.epoch, b.epoch, "%s changed owner without a new epoch", name)
			}
		}
		t.Logf("%s restart: %d acknowledged results intact, %d leases with epochs intact", mode, resultsBefore, len(before))
	}

	created, acked, failed := load.created(t)
	waitCompleted(t, db.Pool, nodes, created, 60*time.Second)
	for _, id := range created {
		require.Equal(t, 1, nodes.executed(id), "command %s executions", id)
	}
	dup, distinct := nodes.twice()
	require.Empty(t, dup, "commands executed twice")
	require.Equal(t, len(created), distinct, "no execution of a command that was never created")
	for name, p := range procs {
		require.False(t, p.Exited(), "%s exited: it must recover in-process\n%s", name, p.Logs())
		p.WaitReady(10 * time.Second)
	}
	t.Logf("commands: %d created (%d acknowledged inserts, %d failed inserts of which %d committed), each executed exactly once",
		len(created), acked, failed, len(created)-acked)
}

func roundAll(m map[string]time.Duration) map[string]string {
	out := map[string]string{}
	for k, v := range m {
		out[k] = v.Round(time.Millisecond).String()
	}
	return out
}
