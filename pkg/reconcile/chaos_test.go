package reconcile_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

// EnvChaosDuration lengthens (or shortens) TestChaosInvariants: a Go
// duration, 60s by default. EnvChaosSeed replays a run.
const (
	EnvChaosDuration = "LEASEHOLD_CHAOS_DURATION"
	EnvChaosSeed     = "LEASEHOLD_CHAOS_SEED"
)

// chaosSchema extends the failover tables so that every fenced write records,
// from inside its own transaction, the lease it was fenced on, that lease's
// epoch and owner, and the lease's expiry when it started and when it
// finished. The fence's FOR KEY SHARE lock keeps that row's owner and epoch
// (key columns: migrations 00015 and 00023) unchanged for the whole
// transaction, so the owner and epoch the trigger reads are exactly those
// the write was fenced at; a renewal may still move expires_at.
const chaosSchema = `
CREATE TABLE key_lease (key text PRIMARY KEY, lease text NOT NULL);
ALTER TABLE reconcile_log ADD COLUMN lease text, ADD COLUMN epoch bigint, ADD COLUMN lease_owner text,
  ADD COLUMN valid_until timestamptz, ADD COLUMN valid_at_finish timestamptz;
ALTER TABLE period_log ADD COLUMN epoch bigint, ADD COLUMN lease_owner text, ADD COLUMN valid_until timestamptz;
CREATE FUNCTION chaos_log_epoch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    SELECT k.lease, l.epoch, l.owner, l.expires_at INTO NEW.lease, NEW.epoch, NEW.lease_owner, NEW.valid_until
      FROM key_lease k JOIN leases l ON l.name = k.lease WHERE k.key = NEW.key;
  ELSE
    SELECT l.expires_at INTO NEW.valid_at_finish FROM leases l WHERE l.name = NEW.lease;
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER chaos_log_epoch BEFORE INSERT OR UPDATE ON reconcile_log FOR EACH ROW EXECUTE FUNCTION chaos_log_epoch();
CREATE FUNCTION chaos_period_epoch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  SELECT l.epoch, l.owner, l.expires_at INTO NEW.epoch, NEW.lease_owner, NEW.valid_until FROM leases l WHERE l.name = 'singleton:ticker';
  RETURN NEW;
END $$;
CREATE TRIGGER chaos_period_epoch BEFORE INSERT ON period_log FOR EACH ROW EXECUTE FUNCTION chaos_period_epoch();
`

// installChaosSchema adds the invariant tables to f's database and maps the
// 500 keys the enqueue loop uses to their shard leases.
func (f failover) installChaosSchema(t *testing.T) {
	t.Helper()
	exec(t, f.db.Pool, chaosSchema)
	keys, leases := make([]string, 500), make([]string, 500)
	for i := range keys {
		keys[i] = fmt.Sprintf("key-%d", i)
		leases[i] = coord.Controllers.ShardLease(coord.ShardOf(keys[i]))
	}
	exec(t, f.db.Pool, `INSERT INTO key_lease SELECT * FROM unnest($1::text[], $2::text[])`, keys, leases)
}

// chaosInvariants are the checks over the invariant tables, each a query
// counting violations, with a query counting what it examined.
var chaosInvariants = []struct{ name, violations, checked string }{
	{"fenced runs of one key by two owners overlapped in time",
		`SELECT count(*) FROM reconcile_log a JOIN reconcile_log b ON a.key = b.key AND a.owner < b.owner
		  AND tstzrange(a.started_at, a.finished_at, '[]') && tstzrange(b.started_at, b.finished_at, '[]')`,
		`SELECT count(*) FROM reconcile_log a JOIN reconcile_log b ON a.key = b.key AND a.owner < b.owner`},
	{"writes of two epochs of one lease interleaved (an older epoch wrote after a newer one began)",
		`SELECT count(*) FROM reconcile_log a JOIN reconcile_log b ON a.lease = b.lease AND a.epoch < b.epoch
		  AND a.finished_at > b.started_at`,
		`SELECT count(*) FROM reconcile_log a JOIN reconcile_log b ON a.lease = b.lease AND a.epoch < b.epoch`},
	{"one epoch of a lease wrote for two owners",
		`SELECT count(*) FROM (SELECT lease, epoch FROM reconcile_log GROUP BY 1, 2 HAVING count(DISTINCT owner) > 1) x`,
		`SELECT count(DISTINCT (lease, epoch)) FROM reconcile_log`},
	{"a write committed for an owner that did not hold the lease",
		`SELECT count(*) FROM reconcile_log WHERE lease_owner IS DISTINCT FROM owner OR epoch IS NULL`,
		`SELECT count(*) FROM reconcile_log`},
	{"a fenced write finished after its lease's validity (ValidUntil)",
		`SELECT count(*) FROM reconcile_log WHERE finished_at IS NULL OR valid_at_finish IS NULL OR finished_at > valid_at_finish OR started_at > valid_until`,
		`SELECT count(*) FROM reconcile_log`},
	{"a period ran twice",
		`SELECT count(*) - count(DISTINCT period) FROM period_log`,
		`SELECT count(*) FROM period_log`},
	{"a period was skipped across a takeover",
		`SELECT count(*) FROM (SELECT period - lag(period) OVER (ORDER BY period) AS d FROM period_log) x WHERE d <> 1`,
		`SELECT count(*) FROM period_log`},
	{"a period was written by a non-holder, or after the singleton's validity",
		`SELECT count(*) FROM period_log WHERE lease_owner IS DISTINCT FROM owner OR at > valid_until`,
		`SELECT count(*) FROM period_log`},
	{"singleton epochs went backwards over periods",
		`SELECT count(*) FROM (SELECT epoch - lag(epoch) OVER (ORDER BY period) AS d FROM period_log) x WHERE d < 0`,
		`SELECT count(*) FROM period_log`},
}

// TestChaosInvariants is the randomized invariant checker: three testworker
// processes share the shards and a periodic singleton while keys are
// enqueued continuously; for LEASEHOLD_CHAOS_DURATION (60 s) a seeded random
// schedule SIGKILLs, pauses (SIGSTOP, often past the 3 s TTL) and resumes,
// SIGTERMs and restarts them. Then every worker comes back, the queue
// drains, and the checker proves from the invariant tables that no two
// epochs of one lease ever committed interleaved writes, that every write
// was fenced by its owner inside the lease's validity, and that the
// periodic singleton neither skipped nor repeated a period. It prints the
// faults injected, the invariants checked and the violations (must be 0).
func TestChaosInvariants(t *testing.T) {
	if testing.Short() {
		t.Skip("randomized real-process fault run")
	}
	t.Parallel()
	runChaos(t, 60*time.Second, false)
}

// TestChaosInvariantsWithDatabaseFaults is the same run with the database
// in the fault mix: besides the workers' kills, pauses and restarts, the
// schedule restarts PostgreSQL (fast, or immediate: a crash) and stops it
// for 1-6 s. Every worker rides through in-process (none may exit), and the
// invariants hold. It is not parallel: a database fault hits every test of
// the binary, so it runs while the parallel tests wait. 30 s by default.
func TestChaosInvariantsWithDatabaseFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("randomized real-process fault run")
	}
	runChaos(t, 30*time.Second, true)
}

func runChaos(t *testing.T, duration time.Duration, dbFaults bool) {
	if v := os.Getenv(EnvChaosDuration); v != "" {
		d, err := time.ParseDuration(v)
		require.NoError(t, err, EnvChaosDuration)
		duration = d
	}
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv(EnvChaosSeed); v != "" {
		s, err := strconv.ParseUint(v, 10, 64)
		require.NoError(t, err, EnvChaosSeed)
		seed = s
	}
	t.Logf("chaos: duration %s, seed %d (%s=%d replays the schedule)", duration, seed, EnvChaosSeed, seed)
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))

	f := setupFailover(t)
	f.installChaosSchema(t)
	var srv interface {
		Restart(testing.TB, bool)
		Stop(testing.TB)
		Start(testing.TB)
	}
	if dbFaults {
		srv = pgtest.Server(t)
		// An immediate shutdown must not lose acknowledged commits: the
		// test cluster turns synchronous_commit off for speed.
		exec(t, f.db.Pool, `ALTER DATABASE `+pgx.Identifier{f.db.Name}.Sanitize()+` SET synchronous_commit = on`)
		f.tolerateOutages = true
	}

	workerArgs := append(slices.Clone(fastArgs), "--work", "20ms")
	if dbFaults {
		// A key may wait for the database until its lease's validity ends
		// (the 3 s TTL) and then for its failure to be recorded (2 s): the
		// self-release bound stays above that, as the defaults' 30 s stays
		// above their TTL. At fastArgs' 2 s a database restart once held a
		// reconcile in RunFenced for 3 s; the watchdog took that for a
		// stall, the survivor released every lease and failed /livez, and
		// with no supervisor here to restart it the queue never drained.
		workerArgs = append(workerArgs, "--coord.self-release-after", "5s")
	}
	ids := []string{"c1", "c2", "c3"}
	procs := map[string]*proctest.Proc{}
	paused := map[string]time.Time{} // id -> resume at
	down := map[string]time.Time{}   // id -> start again at
	for _, id := range ids {
		procs[id] = f.start(t, id, f.db.URL, workerArgs...)
	}
	stop := f.enqueue(t)

	faults := map[string]int{}
	running := func() []string {
		var out []string
		for _, id := range ids {
			if _, ok := down[id]; ok {
				continue
			}
			if _, ok := paused[id]; ok {
				continue
			}
			out = append(out, id)
		}
		return out
	}
	deadline := time.Now().Add(duration)
	step := 0
	for time.Now().Before(deadline) {
		time.Sleep(time.Duration(200+rng.IntN(1300)) * time.Millisecond) // the schedule: the next fault in 0.2-1.5 s
		now := time.Now()
		for _, id := range ids {
			if at, ok := paused[id]; ok && now.After(at) {
				procs[id].Resume()
				delete(paused, id)
				faults["resume"]++
			}
			if at, ok := down[id]; ok && now.After(at) {
				procs[id] = f.start(t, id, f.db.URL, workerArgs...)
				delete(down, id)
				faults["start"]++
			}
		}
		live := running()
		if len(live) == 0 {
			continue
		}
		id := live[rng.IntN(len(live))]
		p := procs[id]
		action := rng.IntN(4)
		step++
		if dbFaults && step%3 == 0 { // every third fault is the database's
			action = 4 + rng.IntN(2)
		}
		switch action {
		case 0: // crash: nothing released, the successor waits out the TTL
			p.Kill()
			down[id] = now.Add(time.Duration(500+rng.IntN(3000)) * time.Millisecond)
			faults["kill"]++
		case 1: // pause, half the time past the 3 s TTL: the zombie must be fenced on resume
			p.Pause()
			paused[id] = now.Add(time.Duration(200+rng.IntN(5000)) * time.Millisecond)
			faults["pause"]++
		case 2: // graceful stop: releases and notifies
			p.Signal(syscall.SIGTERM)
			p.Wait(15 * time.Second)
			down[id] = now.Add(time.Duration(rng.IntN(2000)) * time.Millisecond)
			faults["sigterm"]++
		case 3: // rolling restart: stop and start again at once
			p.Signal(syscall.SIGTERM)
			p.Wait(15 * time.Second)
			procs[id] = f.start(t, id, f.db.URL, workerArgs...)
			faults["restart"]++
		case 4: // the database restarts (fast, or immediate: a crash)
			srv.Restart(t, rng.IntN(2) == 1)
			faults["db-restart"]++
		case 5: // the database is away for 1-6 s
			srv.Stop(t)
			time.Sleep(time.Duration(1000+rng.IntN(5000)) * time.Millisecond) // the fault: the outage
			srv.Start(t)
			faults["db-outage"]++
		}
		if dbFaults {
			for id, p := range procs {
				if _, isDown := down[id]; !isDown {
					require.False(t, p.Exited(), "%s exited: a database fault must not end a process\n%s", id, p.Logs())
				}
			}
		}
	}
	// Heal: every worker back, then let the queue drain.
	for _, id := range ids {
		if _, ok := paused[id]; ok {
			procs[id].Resume()
			faults["resume"]++
		}
		if _, ok := down[id]; ok {
			procs[id] = f.start(t, id, f.db.URL, workerArgs...)
			faults["start"]++
		}
	}
	// Then what a supervisor does: a process that self-released after a
	// stall (a pause past its bound, or a wait it took for one) fails
	// /livez and is restarted, or nothing would ever claim again.
	for _, id := range ids {
		if code, _, err := procs[id].Get("/livez", ""); err != nil || code != 200 {
			procs[id].Kill()
			procs[id] = f.start(t, id, f.db.URL, workerArgs...)
			faults["livez-restart"]++
		}
	}
	enqueued := stop()
	f.drained(t)

	injected := faults["kill"] + faults["pause"] + faults["sigterm"] + faults["restart"] + faults["db-restart"] + faults["db-outage"]
	var rows, epochs, periods int
	require.NoError(t, f.db.Pool.QueryRow(context.Background(),
		`SELECT (SELECT count(*) FROM reconcile_log), (SELECT count(DISTINCT (lease, epoch)) FROM reconcile_log), (SELECT count(*) FROM period_log)`).
		Scan(&rows, &epochs, &periods))
	t.Logf("chaos: %d faults injected (kill %d, pause %d, sigterm %d, restart %d, database restart %d, database outage %d; %d resumes, %d starts) over %s; %d keys enqueued",
		injected, faults["kill"], faults["pause"], faults["sigterm"], faults["restart"], faults["db-restart"], faults["db-outage"],
		faults["resume"], faults["start"], duration, enqueued)
	t.Logf("chaos: %d fenced writes under %d (lease, epoch) pairs, %d periods", rows, epochs, periods)
	total, checked := 0, 0
	for _, inv := range chaosInvariants {
		v := count(t, f.db.Pool, inv.violations)
		c := count(t, f.db.Pool, inv.checked)
		t.Logf("chaos: invariant %-95q checked %8d, violations %d", inv.name, c, v)
		total += v
		checked += c
	}
	t.Logf("chaos: %d invariants, %d checks, %d violations (seed %d)", len(chaosInvariants), checked, total, seed)
	require.Zero(t, total, "invariant violations (replay with %s=%d)", EnvChaosSeed, seed)
	if dbFaults {
		require.Positive(t, faults["db-restart"]+faults["db-outage"], "the run injected database faults")
		require.Greater(t, injected, 4, "the run injected faults")
	} else {
		require.Greater(t, injected, 10, "the run injected faults")
	}
	require.Greater(t, rows, 100, "the run did work")
}

// TestChaosCheckerDetectsViolations feeds the checker's tables one crafted
// history breaking every invariant, so a run reporting 0 violations means
// none happened, not that the queries cannot see them.
func TestChaosCheckerDetectsViolations(t *testing.T) {
	t.Parallel()
	f := setupFailover(t)
	exec(t, f.db.Pool, chaosSchema)
	ctx := context.Background()
	tx, err := f.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SET LOCAL session_replication_role = replica`) // no triggers: write the history as is
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `
INSERT INTO reconcile_log (key, owner, started_at, finished_at, lease, epoch, lease_owner, valid_until, valid_at_finish) VALUES
 ('k1', 'a', '2026-01-01 00:00:00', '2026-01-01 00:00:02', 'shard:1', 1, 'a', '2026-01-01 00:00:05', '2026-01-01 00:00:05'),
 ('k1', 'b', '2026-01-01 00:00:01', '2026-01-01 00:00:03', 'shard:1', 2, 'a', '2026-01-01 00:00:05', '2026-01-01 00:00:02'),
 ('k2', 'c', '2026-01-01 00:00:10', '2026-01-01 00:00:11', 'shard:1', 1, 'c', '2026-01-01 00:00:15', '2026-01-01 00:00:15');
INSERT INTO period_log (period, owner, at, epoch, lease_owner, valid_until) VALUES
 (1, 'a', '2026-01-01 00:00:00', 2, 'a', '2026-01-01 00:00:05'),
 (1, 'b', '2026-01-01 00:00:01', 1, 'a', '2026-01-01 00:00:00'),
 (3, 'a', '2026-01-01 00:00:02', 2, 'a', '2026-01-01 00:00:05')`)
	require.NoError(t, err)
	for _, inv := range chaosInvariants {
		var v int
		require.NoError(t, tx.QueryRow(ctx, inv.violations).Scan(&v))
		require.Positive(t, v, "the checker misses: %s", inv.name)
	}
}
