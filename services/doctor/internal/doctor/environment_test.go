package doctor_test

import (
	"context"
	"net/url"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgbouncer"
	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
	"github.com/leasehold/leasehold/services/doctor/internal/doctor"
	"github.com/leasehold/leasehold/services/doctor/internal/fixture"
)

func TestReadOnlyRoleRunsEveryCheck(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fixture.Healthy(t, b.db.Pool)
	roURL := fixture.ReadOnlyRole(t, b.db.Pool, b.direct, "doctor_ro_"+b.db.Name, true)

	// The role really cannot write.
	conn := connect(t, roURL, "doctor-ro-probe")
	_, err := conn.Exec(context.Background(), `UPDATE leases SET owner = 'x'`)
	require.ErrorContains(t, err, "permission denied")

	// A fenced transaction of another role is visible through pg_monitor.
	holder := connect(t, b.db.URL, "leasehold-gateway:gw-a")
	fence(t, holder, "gateway:gw-a", "gw-a", 1)

	rep := b.runOn(t, roURL)
	require.Equal(t, doctor.Codes(), codesOf(rep))
	for _, f := range rep.Findings {
		requireFinding(t, f, doctor.SeverityOK)
	}
	f, _ := rep.Find(doctor.CodeLeasesStuck)
	requireEvidence(t, f, "fenced_transactions", "1 open")
}

func TestChecksThatCannotRunSaySo(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fixture.Healthy(t, b.db.Pool)
	role := "doctor_nomon_" + b.db.Name
	roURL := fixture.ReadOnlyRole(t, b.db.Pool, b.direct, role, false)
	fixture.Exec(t, b.db.Pool, "REVOKE SELECT ON node_sessions FROM "+role)
	// Without pg_read_all_stats the age of another role's fenced
	// transaction is hidden: leases.stuck cannot conclude.
	holder := connect(t, b.db.URL, "leasehold-worker:w-a")
	fence(t, holder, "singleton:sweeper", "w-a", 1)

	rep := b.runOn(t, roURL)
	f, _ := rep.Find(doctor.CodeGatewaysHeadroom)
	requireFinding(t, f, doctor.SeverityUnknown, "not checked: permission denied")
	require.Contains(t, f.Reason, "node_sessions")
	require.Contains(t, f.Hint, "pg_monitor")

	f, _ = rep.Find(doctor.CodeLeasesStuck)
	requireFinding(t, f, doctor.SeverityUnknown, "1 transaction hold locks on leases but their ages are hidden")
	require.Contains(t, f.Hint, "pg_read_all_stats")

	f, _ = rep.Find(doctor.CodeGatewaysNone)
	requireFinding(t, f, doctor.SeverityOK)
	require.Equal(t, 3, rep.ExitCode(), "a check that could not run must not pass: could not check")
}

func TestPoolingThroughPgBouncerTransactionMode(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.db.Pool
	fixture.Healthy(t, db)
	bouncer := startPgBouncer(t, b.direct)

	// Directly: no pooler, every live worker listens.
	rep := b.runOn(t, b.direct, doctor.CodeDBPooling)
	f := rep.Findings[0]
	requireFinding(t, f, doctor.SeverityOK, "no transaction pooler", "LISTEN available: all 2 live workers listen")
	requireEvidence(t, f, "connection", "direct")

	// Through PgBouncer in transaction mode, with a worker on the polling
	// fallback.
	fixture.Worker(t, db, "w-c", coord.Controllers.Name, 0, "polling")
	rep = b.runOn(t, bouncer)
	f, _ = rep.Find(doctor.CodeDBPooling)
	requireFinding(t, f, doctor.SeverityWarn, "transaction pooler detected", "polling fallback in force: 1 of 3 live workers poll")
	requireEvidence(t, f, "pooler", "transaction")
	requireEvidence(t, f, "connection", "a pooler or proxy is in between")
	requireEvidence(t, f, "workers_polling", "w-c")
	// Every other check runs through the pooler too.
	for _, f := range rep.Findings {
		require.True(t, f.Checked, "%s through PgBouncer: %s", f.Code, f.Reason)
	}
	f, _ = rep.Find(doctor.CodeDBConnections)
	requireEvidence(t, f, "note", "goes through a pooler")

	fixture.Exec(t, db, `UPDATE workers SET notify_mode = 'listen'`)
	rep = b.runOn(t, bouncer, doctor.CodeDBPooling)
	requireFinding(t, rep.Findings[0], doctor.SeverityOK, "transaction pooler detected; LISTEN available: all 3 live workers listen")
}

// startPgBouncer runs a real PgBouncer in transaction mode in front of the
// test server (pkg/pgbouncer) and returns dbURL rewritten to go through it.
func startPgBouncer(t *testing.T, dbURL string) string {
	t.Helper()
	if _, err := pgbouncer.Binary(); err != nil {
		t.Skip("pgbouncer binary not found (apt-get install pgbouncer): skipping the transaction-pooler test")
	}
	u, err := url.Parse(dbURL)
	require.NoError(t, err)
	port, err := strconv.Atoi(u.Port())
	require.NoError(t, err)
	password, _ := u.User.Password()
	b, err := pgbouncer.Start(context.Background(), pgbouncer.Options{
		ServerHost: u.Hostname(), ServerPort: port, User: u.User.Username(), Password: password, PoolSize: 5,
	})
	require.NoError(t, err)
	t.Cleanup(b.Stop)
	return b.URL(strings.TrimPrefix(u.Path, "/"))
}

// TestReplicationAsynchronousStandby streams WAL to pg_receivewal, a real
// asynchronous replication client. Not parallel: pg_stat_replication is
// cluster-wide, and the other tests expect no standby.
func TestReplicationAsynchronousStandby(t *testing.T) {
	b := setup(t)
	f := b.check(t, doctor.CodeDBReplication)
	requireFinding(t, f, doctor.SeverityOK, "no standby replicates from this server")

	binDir, err := pglocal.BinDir()
	if err != nil {
		t.Skipf("no PostgreSQL binaries for pg_receivewal: %v", err)
	}
	u, err := url.Parse(pgtest.Server(t).AdminURL())
	require.NoError(t, err)
	q := u.Query()
	q.Set("application_name", "doctor_test_receiver")
	u.RawQuery = q.Encode()
	dir := t.TempDir()
	cmd := exec.Command(filepath.Join(binDir, "pg_receivewal"), "-D", dir, "-d", u.String(), "--no-loop")
	logs := &proctest.Buffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	require.NoError(t, cmd.Start())
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		// Wait for the walsender to go before the parallel tests run.
		require.Eventually(t, func() bool {
			var n int
			_ = b.db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM pg_stat_replication").Scan(&n)
			return n == 0
		}, 10*time.Second, 50*time.Millisecond)
	}()
	require.Eventually(t, func() bool {
		var n int
		_ = b.db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'").Scan(&n)
		return n == 1
	}, 15*time.Second, 50*time.Millisecond, "pg_receivewal did not stream: %s", logs)

	f = b.check(t, doctor.CodeDBReplication)
	requireFinding(t, f, doctor.SeverityWarn, "asynchronous standby only (1): a failover can lose recent commits")
	requireEvidence(t, f, "standby", "doctor_test_receiver", "streaming async")
}
