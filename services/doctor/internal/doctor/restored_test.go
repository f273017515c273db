package doctor_test

import (
	"context"
	"log/slog"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/services/doctor/internal/doctor"
	"github.com/leasehold/leasehold/services/doctor/internal/fixture"
)

func TestRestoredReportsDetectionsUntilAcknowledged(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.db.Pool
	f := b.check(t, doctor.CodeDBRestored)
	requireFinding(t, f, doctor.SeverityOK, "no process found the database behind", "generation 0")
	requireEvidence(t, f, "instance", "-")

	fixture.Exec(t, db, `UPDATE leasehold_instance SET generation = 1, generation_at = compute_now()`)
	fixture.Exec(t, db, `
INSERT INTO epoch_regressions (detected_at, detected_by, lease_name, seen_epoch, found_epoch, seen_floor, found_floor, seen_grants, found_grants, raised_generation)
VALUES (compute_now() - interval '2 minutes', 'w-a', NULL, NULL, NULL, 0, 0, 40, 31, 1),
       (compute_now() - interval '1 minute', 'gw-a', 'gateway:gw-a', 7, 4, 0, 0, 41, 31, NULL)`)
	f = b.check(t, doctor.CodeDBRestored)
	requireFinding(t, f, doctor.SeverityCritical, "the database went back in time: gw-a held gateway:gw-a at epoch 7 but the database had it at epoch 4",
		"2 detections", "docs/database-failover.md#a-database-restored-from-an-earlier-backup")
	require.Contains(t, f.Hint, "generation 1")
	require.Contains(t, f.Hint, "acknowledged_at")
	requireEvidence(t, f, "regression", "by w-a", "40 grants seen", "the database had 31", "raised the generation to 1")
	requireEvidence(t, f, "regression", "by gw-a", "gateway:gw-a held at epoch 7, the database had epoch 4")
	requireEvidence(t, f, "generation", "1")

	fixture.Exec(t, db, `UPDATE epoch_regressions SET acknowledged_at = compute_now() WHERE acknowledged_at IS NULL`)
	f = b.check(t, doctor.CodeDBRestored)
	requireFinding(t, f, doctor.SeverityOK, "generation 1")
	requireEvidence(t, f, "acknowledged", "2")

	fixture.Exec(t, db, `DELETE FROM leasehold_instance`)
	f = b.check(t, doctor.CodeDBRestored)
	requireFinding(t, f, doctor.SeverityCritical, "leasehold_instance row is missing")
}

// TestRestoredDumpReusesNoEpoch restores a pg_dump taken earlier under a
// live process. The process keeps a gateway lease (Keeper) and takes a
// singleton (AcquireMany); a second process takes the singleton too. After
// the dump every lease changes hands; then the operator restores the dump
// into a new database and swaps it in under the old name, and the live
// process carries on. No epoch handed out after the restore is at or below
// any epoch handed out before, and the doctor says what happened.
func TestRestoredDumpReusesNoEpoch(t *testing.T) {
	t.Parallel()
	bin, err := pglocal.BinDir()
	if err != nil {
		t.Skipf("no PostgreSQL client binaries: %v", err)
	}
	b := setup(t)
	ctx := context.Background()
	live, err := pgdb.Connect(ctx, pgdb.Config{URL: b.direct, AppName: "leasehold-gateway:gw-live", MaxConns: 4})
	require.NoError(t, err)
	defer live.Close()

	var mu sync.Mutex
	var regs []coord.Regression
	observe := func(r coord.Regression) { mu.Lock(); regs = append(regs, r); mu.Unlock() }
	gw, err := coord.NewClient(live, "gw-live", coord.WithRegressionObserver(observe))
	require.NoError(t, err)
	worker, err := coord.NewClient(live, "w-live", coord.WithRegressionObserver(observe))
	require.NoError(t, err)
	other, err := coord.NewClient(live, "w-other", coord.WithRegressionObserver(observe))
	require.NoError(t, err)

	acquired, lost := make(chan coord.Lease, 16), make(chan string, 16)
	// A wide trust window: the test is about epochs, not timing, and under
	// the race detector on a busy machine a take or renewal can take seconds
	// (a take that returns after its trust window is thrown away and tried
	// again, which on a 2 s window could go on for a minute).
	k, err := coord.NewKeeper(gw, coord.KeeperConfig{Name: "gateway:gw-live", TTL: 30 * time.Second, Renew: 100 * time.Millisecond, Trust: 10 * time.Second,
		OnAcquired: func(l coord.Lease) { acquired <- l }, OnLost: func(_ coord.Lease, reason string) { lost <- reason }},
		slog.New(slog.NewTextHandler(t.Output(), nil))) // the keeper's retries show when a take is slow
	require.NoError(t, err)
	kctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { k.Run(kctx) })
	defer wg.Wait()
	defer stop()

	var before []int64 // every epoch handed out before the restore
	take := func(c *coord.Client, name string) coord.Lease {
		t.Helper()
		l, ok, err := c.Acquire(ctx, name, time.Minute)
		require.NoError(t, err)
		require.True(t, ok, "%s takes %s", c.Owner(), name)
		return l
	}
	before = append(before, wait(t, acquired, "the first take").Epoch, take(worker, "singleton:sweeper").Epoch)

	dump := filepath.Join(t.TempDir(), "leasehold.dump")
	run(t, filepath.Join(bin, "pg_dump"), "--format=custom", "--file="+dump, "--dbname="+b.direct)

	// After the backup: two new holdings of the gateway lease; the
	// singleton goes to another process and back.
	for range 2 {
		k.Drop("test: a new holding")
		wait(t, lost, "the drop")
		before = append(before, wait(t, acquired, "the take after the drop").Epoch)
	}
	_, err = worker.Release(ctx, "singleton:sweeper")
	require.NoError(t, err)
	before = append(before, take(other, "singleton:sweeper").Epoch)
	_, err = other.Release(ctx, "singleton:sweeper")
	require.NoError(t, err)
	before = append(before, take(worker, "singleton:sweeper").Epoch)
	maxBefore := before[0]
	for _, e := range before {
		maxBefore = max(maxBefore, e)
	}
	require.GreaterOrEqual(t, maxBefore, int64(3))
	t.Logf("epochs handed out before the restore: %v", before)

	restoreUnderTheSameName(t, bin, b, dump)

	var after []int64 // every new holding after the restore
	for {
		l := wait(t, acquired, "the gateway's take after the restore")
		after = append(after, l.Epoch)
		if coord.Generation(l.Floor) > 0 {
			break
		}
	}
	s := take(worker, "singleton:sweeper")
	after = append(after, s.Epoch)
	t.Logf("epochs handed out after the restore: %v", after)
	for _, e := range after {
		require.Greater(t, e, maxBefore, "an epoch handed out after the restore (%v) is at or below one handed out before it (%v)", after, before)
	}
	_, ok, err := other.Acquire(ctx, "singleton:sweeper", time.Minute)
	require.NoError(t, err)
	require.False(t, ok, "the singleton has one holder")

	mu.Lock()
	require.NotEmpty(t, regs, "the live process detected the restore")
	mu.Unlock()

	f := b.checkOn(t, b.direct, doctor.CodeDBRestored)
	requireFinding(t, f, doctor.SeverityCritical, "the database went back in time", "docs/database-failover.md#a-database-restored-from-an-earlier-backup")
	requireEvidence(t, f, "regression", "gw-live", "gateway:gw-live held at epoch")
	requireEvidence(t, f, "generation", "1")

	// The operator followed the procedure and acknowledges.
	conn := connect(t, b.direct, "operator")
	_, err = conn.Exec(ctx, `UPDATE epoch_regressions SET acknowledged_at = now() WHERE acknowledged_at IS NULL`)
	require.NoError(t, err)
	requireFinding(t, b.checkOn(t, b.direct, doctor.CodeDBRestored), doctor.SeverityOK, "generation 1")
}

// restoreUnderTheSameName restores dump into a new database and swaps it in
// under the test database's name, as an operator restoring a backup next to
// the broken database and renaming it would: connections to the old one are
// cut, and the live process's pool redials into the restored one.
func restoreUnderTheSameName(t *testing.T, bin string, b *bundle, dump string) {
	t.Helper()
	ctx := context.Background()
	admin := connect(t, pgtest.Server(t).AdminURL(), "operator")
	name := b.db.Name
	restored, replaced := name+"_restored", name+"_replaced"
	_, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{restored}.Sanitize()+" TEMPLATE template0")
	require.NoError(t, err)
	run(t, filepath.Join(bin, "pg_restore"), "--exit-on-error", "--dbname="+fixture.DirectURL(pgtest.Server(t).AdminURL(), restored), dump)

	_, err = admin.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{name}.Sanitize()+" ALLOW_CONNECTIONS false")
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		_, err := admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1`, name)
		require.NoError(t, err)
		_, err = admin.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{name}.Sanitize()+" RENAME TO "+pgx.Identifier{replaced}.Sanitize())
		return err == nil
	}, 30*time.Second, 50*time.Millisecond, "rename the database the backup replaces")
	_, err = admin.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{restored}.Sanitize()+" RENAME TO "+pgx.Identifier{name}.Sanitize())
	require.NoError(t, err)
}

func run(t *testing.T, prog string, args ...string) {
	t.Helper()
	out, err := exec.Command(prog, args...).CombinedOutput()
	require.NoError(t, err, "%s: %s", filepath.Base(prog), out)
}

func wait[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(time.Minute):
		t.Fatalf("timed out waiting for %s", what)
		panic("unreachable")
	}
}

// checkOn runs one check against url.
func (b *bundle) checkOn(t *testing.T, url, code string) doctor.Finding {
	t.Helper()
	rep := b.runOn(t, url, code)
	require.Len(t, rep.Findings, 1)
	f := rep.Findings[0]
	t.Logf("%s %s: %s%s", f.Severity, f.Code, f.Summary, evidenceText(f))
	return f
}
