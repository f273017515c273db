package doctor_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/services/doctor/internal/doctor"
	"github.com/leasehold/leasehold/services/doctor/internal/fixture"
)

func TestHealthyDeploymentReportsAllOK(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fixture.Healthy(t, b.db.Pool)
	rep := b.runOn(t, b.db.URL)
	require.Equal(t, doctor.Codes(), codesOf(rep))
	for _, f := range rep.Findings {
		requireFinding(t, f, doctor.SeverityOK)
		require.NotEmpty(t, f.Summary)
	}
	require.Equal(t, 0, rep.ExitCode())
	require.WithinDuration(t, time.Now(), rep.CheckedAt, time.Minute)
}

func codesOf(rep doctor.Report) []string {
	var out []string
	for _, f := range rep.Findings {
		out = append(out, f.Code)
	}
	return out
}

func TestUnknownCodeIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	d, err := doctor.New(b.cfg, b.db.Pool)
	require.NoError(t, err)
	_, err = d.Run(context.Background(), []string{"workers.queue", "no.such"})
	var unknown *doctor.UnknownCodeError
	require.ErrorAs(t, err, &unknown)
	require.Equal(t, []string{"no.such"}, unknown.Codes)
}

// Ages in summaries and evidence are asserted up to their last digits: on
// a loaded machine a check may run a second or two after its fixture.

func TestQueueOverdueWithAndWithoutWorkers(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.db.Pool
	// Stop all workers: no workers rows at all, work 6 and 1 minutes late,
	// and a claim that expired 7 minutes ago.
	fixture.Exec(t, db, `INSERT INTO work_queue (reconciler, key, shard, due_at, attempts, last_error) VALUES
	  ('node', 'n-late', 4, compute_now() - interval '6 minutes', 3, 'boom'),
	  ('node', 'n-recent', 5, compute_now() - interval '1 minute', 0, NULL),
	  ('site', 's-claimed', 6, 'infinity', 1, NULL)`)
	fixture.Exec(t, db, `UPDATE work_queue SET claimed_by = 'w-dead', claimed_until = compute_now() - interval '7 minutes' WHERE key = 's-claimed'`)
	f := b.check(t, doctor.CodeWorkersQueue)
	requireFinding(t, f, doctor.SeverityCritical, "2 keys overdue", "and no worker is alive")
	requireEvidence(t, f, "key", "site/s-claimed", "expired claim of w-dead")
	requireEvidence(t, f, "key", "node/n-late", "attempts 3", `"boom"`)
	requireEvidence(t, f, "reconciler", "node: 1 overdue")

	// A worker whose heartbeat is 2 minutes old is not alive either.
	fixture.Worker(t, db, "w-old", coord.Controllers.Name, 120, "listen")
	f = b.check(t, doctor.CodeWorkersQueue)
	requireFinding(t, f, doctor.SeverityCritical, "and no worker is alive")
	requireEvidence(t, f, "workers_alive", "last heartbeat 2m", "s ago")

	fixture.Worker(t, db, "w-a", coord.Controllers.Name, 0, "listen")
	f = b.check(t, doctor.CodeWorkersQueue)
	requireFinding(t, f, doctor.SeverityWarn, "2 keys overdue")
	require.NotContains(t, f.Summary, "no worker is alive")

	fixture.Exec(t, db, `DELETE FROM work_queue WHERE key <> 'n-recent'`)
	requireFinding(t, b.check(t, doctor.CodeWorkersQueue), doctor.SeverityOK, "1 key queued, 1 due now")
}

func TestSweeperStale(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.db.Pool
	f := b.check(t, doctor.CodeWorkersSweeper)
	requireFinding(t, f, doctor.SeverityOK, "has not completed a period yet")

	fixture.Lease(t, db, "singleton:sweeper", "w-a", 4, -20)
	fixture.Sweeper(t, db, 1000, 10) // 10 s old, 1 s periods
	f = b.check(t, doctor.CodeWorkersSweeper)
	requireFinding(t, f, doctor.SeverityWarn, "last completed a period 1", "s ago, more than 3 periods of 1s")
	requireEvidence(t, f, "lease", "singleton:sweeper expired 2", "s ago", "last owner w-a", "epoch 4")
	requireEvidence(t, f, "last_completed", "period 42 by w-a")

	fixture.Sweeper(t, db, 10_000, 10) // 10 s old, 10 s periods
	requireFinding(t, b.check(t, doctor.CodeWorkersSweeper), doctor.SeverityOK, "completed a period 1", "s ago")
}

func TestMembershipSilentMemberAndOrphans(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.db.Pool
	members := []string{"w-a", "w-b", "w-c"}
	fixture.Worker(t, db, "w-a", coord.Controllers.Name, 0, "listen")
	fixture.Worker(t, db, "w-b", coord.Controllers.Name, 0, "listen")
	// w-c stopped renewing 20 s ago: silent (> 15 s TTL) but still live (< 30 s).
	fixture.Worker(t, db, "w-c", coord.Controllers.Name, 20, "listen")
	fixture.Worker(t, db, "w-gone", coord.Controllers.Name, 45, "listen") // out of the live set
	fixture.ShardLeases(t, db, coord.Controllers, members)
	owners := coord.Assign(members)
	var orphans []int
	for s, o := range owners {
		if o == "w-c" {
			orphans = append(orphans, s)
		}
	}
	require.NotEmpty(t, orphans)
	// Survivor w-a took over all of w-c's shards but the first, whose lease
	// is still w-c's and expired.
	for _, s := range orphans[1:] {
		fixture.Lease(t, db, coord.Controllers.ShardLease(s), "w-a", 2, 15)
	}
	fixture.Lease(t, db, coord.Controllers.ShardLease(orphans[0]), "w-c", 1, -3)

	f := b.check(t, doctor.CodeWorkersMembership)
	requireFinding(t, f, doctor.SeverityWarn, "controllers: 1 member of 3 silent but still in the live set",
		fmt.Sprintf("%d orphaned shards, %d taken over by other members", len(orphans), len(orphans)-1))
	// Ages on a loaded machine may be a second or two past the fixture's.
	requireEvidence(t, f, "silent_member", "w-c", "last heartbeat 2", "s ago")
	requireEvidence(t, f, "controllers.takeover", "TTL path only: w-a, w-b, w-c")
	requireEvidence(t, f, "orphaned_shards", "w-c", fmt.Sprintf("held by other members: w-a %d", len(orphans)-1), "1 unheld")
	requireEvidence(t, f, "orphan", coord.Controllers.ShardLease(orphans[0]), "expired", "s ago", "last owner w-c")
	requireEvidence(t, f, "orphan", coord.Controllers.ShardLease(orphans[1]), "held by w-a epoch 2")
	for _, e := range f.Evidence {
		require.NotContains(t, e.Value, "w-gone", "a member out of the live set is not silent")
	}

	// The scheduler group: rows scheduler/<id>, leases owned by <id>.
	fixture.Worker(t, db, "scheduler/p1", coord.Scheduler.Name, 0, "listen")
	fixture.Worker(t, db, "scheduler/p2", coord.Scheduler.Name, 16, "listen")
	fixture.ShardLeases(t, db, coord.Scheduler, []string{"scheduler/p1"})
	f = b.check(t, doctor.CodeWorkersMembership)
	requireFinding(t, f, doctor.SeverityWarn, "scheduler: 1 member of 2 silent")
	requireEvidence(t, f, "orphaned_shards", "scheduler/p2", "scheduler/p1 ")

	// Every live member silent: nobody renews.
	fixture.Exec(t, db, `UPDATE workers SET heartbeat_at = compute_now() - interval '20 seconds'`)
	f = b.check(t, doctor.CodeWorkersMembership)
	requireFinding(t, f, doctor.SeverityCritical, "every live member (4) is silent")

	fixture.Exec(t, db, `UPDATE workers SET heartbeat_at = compute_now()`)
	requireFinding(t, b.check(t, doctor.CodeWorkersMembership), doctor.SeverityOK, "controllers: 4 members live, none silent")
}

func TestClockSkew(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.db.Pool
	fixture.Worker(t, db, "w-a", coord.Controllers.Name, 0, "listen")
	fixture.Worker(t, db, "w-b", coord.Controllers.Name, 0, "listen")
	fixture.Exec(t, db, `UPDATE workers SET clock_skew_ms = 900 WHERE id = 'w-a'`)
	requireFinding(t, b.check(t, doctor.CodeLeasesClockSkew), doctor.SeverityOK)
	fixture.Exec(t, db, `UPDATE workers SET clock_skew_ms = -2500 WHERE id = 'w-b'`)
	f := b.check(t, doctor.CodeLeasesClockSkew)
	requireFinding(t, f, doctor.SeverityWarn, "1 process reports ClockSkew", "w-b at -2500ms")
	requireEvidence(t, f, "worker", "w-b (host-w-b, controllers) skew -2500ms")
}

// fence opens a transaction on conn fenced on lease name like every write
// of its holder (docs/design.md#fencing) and leaves it open.
func fence(t *testing.T, conn *pgx.Conn, name, owner string, epoch int64) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := conn.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	var one int
	require.NoError(t, tx.QueryRow(ctx, `SELECT 1 FROM leases
	 WHERE name = $1 AND owner = $2 AND epoch = $3 AND expires_at > compute_now() FOR KEY SHARE`, name, owner, epoch).Scan(&one))
	return tx
}

func connect(t *testing.T, url, app string) *pgx.Conn {
	t.Helper()
	cfg, err := pgx.ParseConfig(url)
	require.NoError(t, err)
	cfg.RuntimeParams["application_name"] = app
	cfg.DefaultQueryExecMode = pgx.QueryExecModeExec // safe through PgBouncer too
	conn, err := pgx.ConnectConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

func TestStuckLeaseHeldPastExpiryByFencedTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.db.Pool
	b.cfg.LeaseTTL = 2 * time.Second
	fixture.Lease(t, db, "shard:7", "w-a", 3, 1) // expires in 1 s
	fixture.Lease(t, db, "shard:8", "w-a", 3, 3600)
	requireFinding(t, b.check(t, doctor.CodeLeasesStuck), doctor.SeverityOK)

	holder := connect(t, b.db.URL, "leasehold-worker:w-a")
	tx := fence(t, holder, "shard:7", "w-a", 3)
	// The holder keeps its fenced transaction open past the lease's expiry.
	require.Eventually(t, func() bool {
		var expired bool
		err := db.QueryRow(context.Background(), "SELECT expires_at < compute_now() FROM leases WHERE name = 'shard:7'").Scan(&expired)
		return err == nil && expired
	}, 30*time.Second, 20*time.Millisecond, "shard:7 expires")
	var pid uint32
	require.NoError(t, tx.QueryRow(context.Background(), "SELECT pg_backend_pid()").Scan(&pid))

	f := b.check(t, doctor.CodeLeasesStuck)
	requireFinding(t, f, doctor.SeverityCritical, "1 lease held past expiry by an open transaction", "shard:7",
		fmt.Sprintf("still locked by pid %d", pid))
	requireEvidence(t, f, "stuck_lease", "shard:7 owner w-a epoch 3", fmt.Sprintf("pid %d", pid), "leasehold-worker:w-a", "idle in transaction")

	// A takeover really waits for it.
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := db.Exec(ctx, `UPDATE leases SET owner = 'w-b', epoch = epoch + 1 WHERE name = 'shard:7' AND expires_at < compute_now()`)
	require.Error(t, err, "the takeover must wait for the fenced transaction")

	require.NoError(t, tx.Rollback(context.Background()))
	requireFinding(t, b.check(t, doctor.CodeLeasesStuck), doctor.SeverityOK)

	// A fenced transaction on a live lease that outlives the lease TTL.
	tx = fence(t, holder, "shard:8", "w-a", 3)
	require.Eventually(t, func() bool {
		var older bool
		// Observed from another session: a statement on tx would replace
		// the fence as the transaction's last statement.
		// By application_name: behind PgBouncer the client's pid is not
		// the server backend's.
		var o *bool
		err := db.QueryRow(context.Background(), "SELECT bool_or(clock_timestamp() - xact_start > $1::interval) FROM pg_stat_activity WHERE application_name = $2 AND xact_start IS NOT NULL",
			"2.2 seconds", "leasehold-worker:w-a").Scan(&o)
		older = o != nil && *o
		return err == nil && older
	}, 30*time.Second, 20*time.Millisecond, "the fenced transaction outlives the lease TTL")
	f = b.check(t, doctor.CodeLeasesStuck)
	requireFinding(t, f, doctor.SeverityWarn, "1 transaction has held FOR KEY SHARE locks on leases longer than the lease TTL 2s")
	requireEvidence(t, f, "long_fenced_transaction", "leasehold-worker:w-a", "FOR KEY SHARE")
	require.NoError(t, tx.Rollback(context.Background()))
}

func TestGatewaysNone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.db.Pool
	requireFinding(t, b.check(t, doctor.CodeGatewaysNone), doctor.SeverityWarn, "no gateway is running (no nodes registered yet)")
	fixture.Nodes(t, db, "n", 3, "disconnected", 30)
	fixture.Lease(t, db, "gateway:gw-old", "gw-old", 1, -90)
	f := b.check(t, doctor.CodeGatewaysNone)
	requireFinding(t, f, doctor.SeverityCritical, "no gateway holds a live lease: none of 3 registered nodes can connect")
	requireEvidence(t, f, "expired_gateway", "gw-old expired 1m3", "s ago")
	fixture.Lease(t, db, "gateway:gw-a", "gw-a", 1, 20)
	f = b.check(t, doctor.CodeGatewaysNone)
	requireFinding(t, f, doctor.SeverityOK, "1 gateway holds a live lease")
	requireEvidence(t, f, "gateway", "gw-a held by gw-a epoch 1")
}

func TestGatewayHeadroomNMinusOne(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.db.Pool
	b.cfg.MaxStreams = 10
	requireFinding(t, b.check(t, doctor.CodeGatewaysHeadroom), doctor.SeverityOK, "no live gateways")

	// A lone gateway with no sessions survives nothing: the summary must
	// not say it does.
	fixture.Lease(t, db, "gateway:gw-solo", "gw-solo", 1, 20)
	f := b.check(t, doctor.CodeGatewaysHeadroom)
	requireFinding(t, f, doctor.SeverityOK, "region default: one gateway (gw-solo) and no sessions", "leaves the region no gateway")
	require.NotContains(t, f.Summary, "survive")
	fixture.Exec(t, db, `DELETE FROM leases WHERE name = 'gateway:gw-solo'`)

	fixture.Lease(t, db, "gateway:gw-a", "gw-a", 1, 20)
	fixture.Lease(t, db, "gateway:gw-b", "gw-b", 1, 20)
	fixture.Lease(t, db, "gateway:gw-dead", "gw-dead", 1, -60)
	fixture.Sessions(t, db, "gw-a", 9) // near maxStreams
	fixture.Sessions(t, db, "gw-b", 3)
	fixture.Sessions(t, db, "gw-dead", 4) // a dead gateway's sessions do not count
	f = b.check(t, doctor.CodeGatewaysHeadroom)
	requireFinding(t, f, doctor.SeverityWarn, "region default: losing gw-a (9 sessions) leaves 12 sessions for 1 gateway of 10 streams (2 short)")
	requireEvidence(t, f, "gateway", "gw-a (default): 9/10 sessions (90%)")
	requireEvidence(t, f, "region", "default: 2 gateways, 12 sessions, N-1 capacity 10")

	// A third gateway gives the region N-1 headroom.
	fixture.Lease(t, db, "gateway:gw-c", "gw-c", 1, 20)
	requireFinding(t, b.check(t, doctor.CodeGatewaysHeadroom), doctor.SeverityOK, "region default: the other 2 gateways hold all 12 sessions if gw-a is lost")

	// Regions: each is judged alone.
	require.NoError(t, b.cfg.Regions.Set("gw-a=eu, gw-b=us,gw-c*=us"))
	f = b.check(t, doctor.CodeGatewaysHeadroom)
	requireFinding(t, f, doctor.SeverityWarn, "region eu: one gateway (gw-a, 9 sessions)")
	require.NotContains(t, f.Summary, "region us")

	// A gateway at maxStreams refuses nodes now.
	fixture.Exec(t, db, `UPDATE node_sessions SET gateway_id = 'gw-a' WHERE gateway_id = 'gw-b' AND node_id = 'gw-b-n-1'`)
	f = b.check(t, doctor.CodeGatewaysHeadroom)
	requireFinding(t, f, doctor.SeverityCritical, "region eu: 1 gateway at --max-streams 10 (gw-a)")
}

func TestNodesUnreachableAndDisconnected(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.db.Pool
	requireFinding(t, b.check(t, doctor.CodeNodesUnreachable), doctor.SeverityOK, "no node is unreachable (0 nodes registered)")
	fixture.Nodes(t, db, "ok", 6, "connected", 0)
	fixture.Nodes(t, db, "lost", 2, "unreachable", 600)
	fixture.Exec(t, db, `UPDATE nodes SET updated_at = compute_now() - interval '20 minutes' WHERE id = 'lost-2'`)
	fixture.Exec(t, db, `INSERT INTO node_sessions (node_id, gateway_id, session_epoch, state, session_expires_at)
	  VALUES ('lost-2', 'gw-x', 7, 'disconnected', compute_now() - interval '19 minutes')`)
	fixture.Nodes(t, db, "off", 1, "disconnected", 45)

	f := b.check(t, doctor.CodeNodesUnreachable)
	requireFinding(t, f, doctor.SeverityWarn, "2 of 9 nodes unreachable, the oldest lost-2 for 20m")
	requireEvidence(t, f, "node", "lost-2 (node) unreachable for 20m", "s, last gateway gw-x session epoch 7")
	requireEvidence(t, f, "unreachable", "2")

	f = b.check(t, doctor.CodeNodesDisconnected)
	// The fixture dates the disconnect 45 s back; a busy machine may take a
	// second or two to reach the check.
	requireFinding(t, f, doctor.SeverityWarn, "1 of 9 nodes disconnected, the oldest off-1 for 4")
	require.Regexp(t, `for 4[5-9]s$`, f.Summary)

	fixture.Exec(t, db, `UPDATE nodes SET state = 'unreachable' WHERE id LIKE 'ok-%'`)
	requireFinding(t, b.check(t, doctor.CodeNodesUnreachable), doctor.SeverityCritical, "8 of 9 nodes unreachable")
}

func TestSitesBoot(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.db.Pool
	requireFinding(t, b.check(t, doctor.CodeSitesBoot), doctor.SeverityOK, "no site agents registered")
	fixture.SiteAgent(t, db, "s1-a", "s1", "connected")
	fixture.SiteAgent(t, db, "s1-b", "s1", "connected")
	fixture.Lease(t, db, "site:s1:boot", "s1-a", 2, 15)
	requireFinding(t, b.check(t, doctor.CodeSitesBoot), doctor.SeverityOK, "every site (1)")

	// s2: one agent only; it holds the boot lease.
	fixture.SiteAgent(t, db, "s2-a", "s2", "connected")
	fixture.SiteAgent(t, db, "s2-b", "s2", "disconnected")
	fixture.Lease(t, db, "site:s2:boot", "s2-a", 1, 15)
	f := b.check(t, doctor.CodeSitesBoot)
	requireFinding(t, f, doctor.SeverityWarn, "1 site with one connected agent only (s2)")
	requireEvidence(t, f, "site", "s2: boot lease held by s2-a epoch 1", "s2-b disconnected")

	// s3: its boot lease expired and nobody took it.
	fixture.SiteAgent(t, db, "s3-a", "s3", "connected")
	fixture.SiteAgent(t, db, "s3-b", "s3", "connected")
	fixture.Lease(t, db, "site:s3:boot", "s3-a", 4, -30)
	f = b.check(t, doctor.CodeSitesBoot)
	requireFinding(t, f, doctor.SeverityCritical, "1 site without an active boot agent (s3)", "one connected agent only (s2)")
	requireEvidence(t, f, "site", "s3: no active boot agent (boot lease expired 3", "s ago (epoch 4, last owner s3-a))")
}

func TestMigrationsPendingAndNewer(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.db.Pool
	f := b.check(t, doctor.CodeDBMigrations)
	requireFinding(t, f, doctor.SeverityOK, "as this binary expects")
	fixture.Exec(t, db, `DELETE FROM goose_db_version WHERE version_id = (SELECT max(version_id) FROM goose_db_version)`)
	f = b.check(t, doctor.CodeDBMigrations)
	requireFinding(t, f, doctor.SeverityWarn, "1 migration pending")
	requireEvidence(t, f, "pending", "1")
	fixture.Exec(t, db, `INSERT INTO goose_db_version (version_id, is_applied) VALUES (99999, true)`)
	f = b.check(t, doctor.CodeDBMigrations)
	requireFinding(t, f, doctor.SeverityCritical, "(version 99999) is newer than this binary")
}

func TestVersionAndConnections(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fixture.Healthy(t, b.db.Pool)
	f := b.check(t, doctor.CodeDBVersion)
	requireFinding(t, f, doctor.SeverityOK, "PostgreSQL ")
	requireEvidence(t, f, "version", "PostgreSQL")

	f = b.check(t, doctor.CodeDBConnections)
	requireFinding(t, f, doctor.SeverityOK)
	requireEvidence(t, f, "processes", "workers 2 (live)", "gateways 3 (live)")
	b.cfg.ExpectWorkers = 100
	f = b.check(t, doctor.CodeDBConnections)
	requireFinding(t, f, doctor.SeverityCritical, "the processes may open 1134 connections but max_connections leaves")
	requireEvidence(t, f, "processes", "workers 100 (configured)")
}

func TestVersionBelow14Warns(t *testing.T) {
	t.Parallel()
	f := doctor.ClassifyVersion(130011)
	require.Equal(t, doctor.SeverityWarn, f.Severity)
	require.Contains(t, f.Summary, "PostgreSQL 13 is older than 14")
	require.Equal(t, doctor.SeverityOK, doctor.ClassifyVersion(150004).Severity)
}
