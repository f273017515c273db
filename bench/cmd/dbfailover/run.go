package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leasehold/leasehold/bench/internal/fleet"
	"github.com/leasehold/leasehold/bench/internal/harness"
	"github.com/leasehold/leasehold/pkg/fleettest"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgha"
)

// leaseLog records every grant and release of a lease, from inside the
// statement that made it, with the database's clock.
const leaseLog = `
CREATE TABLE bench_lease_log (seq bigserial PRIMARY KEY, name text NOT NULL, owner text, epoch bigint NOT NULL,
  expires_at timestamptz NOT NULL, at timestamptz NOT NULL DEFAULT compute_now());
CREATE INDEX ON bench_lease_log (name, at);
CREATE FUNCTION bench_lease_log() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' OR NEW.owner IS DISTINCT FROM OLD.owner OR NEW.epoch <> OLD.epoch OR NEW.expires_at <> OLD.expires_at THEN
    INSERT INTO bench_lease_log (name, owner, epoch, expires_at) VALUES (NEW.name, NEW.owner, NEW.epoch, NEW.expires_at);
  END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER bench_lease_log AFTER INSERT OR UPDATE ON leases FOR EACH ROW EXECUTE FUNCTION bench_lease_log();
`

// overlapSQL counts grants to a new owner made while the previous grant of
// the same lease (to another owner, not released since) was still valid.
const overlapSQL = `
SELECT count(*) FROM (
  SELECT owner, at, lag(owner) OVER w AS prev_owner, lag(expires_at) OVER w AS prev_expires
    FROM bench_lease_log WINDOW w AS (PARTITION BY name ORDER BY seq)) x
 WHERE owner IS NOT NULL AND prev_owner IS NOT NULL AND owner <> prev_owner AND at < prev_expires`

// sameEpochSQL counts (lease, epoch) pairs the log shows granted to two owners.
const sameEpochSQL = `
SELECT count(*) FROM (SELECT name, epoch FROM bench_lease_log WHERE owner IS NOT NULL
  GROUP BY 1, 2 HAVING count(DISTINCT owner) > 1) x`

type run struct {
	c        config
	scenario string
	pair     *pgha.Pair
	f        *fleet.Fleet
	mu       sync.Mutex
}

func (r *run) logf(format string, args ...any) {
	if r.c.progress {
		fmt.Fprintf(os.Stderr, "%s [%s] %s\n", time.Now().Format("15:04:05.000"), r.scenario, fmt.Sprintf(format, args...))
	}
}

// kill stops whatever this run started (a second Ctrl-C).
func (r *run) kill() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.f != nil {
		r.f.Sup.Stop()
	}
	if r.pair != nil {
		_ = r.pair.Close()
	}
}

func (r *run) do(ctx context.Context) (*scenarioResult, error) {
	sr := &scenarioResult{Scenario: r.scenario}
	syncRep := r.scenario != "promote-async"
	sr.Replication = map[bool]string{true: "synchronous", false: "asynchronous"}[syncRep]
	r.logf("starting a primary and a %s standby", sr.Replication)
	pair, err := pgha.New(ctx, pgha.Options{Sync: syncRep, NoMigrate: true,
		Settings: map[string]string{"max_connections": "600", "pg_stat_statements.max": "10000"}})
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	r.pair = pair
	r.mu.Unlock()
	defer func() { _ = pair.Close() }()

	f, err := fleet.Start(ctx, fleet.Options{Gateways: 2, Timings: r.c.timings, BinDir: r.c.binDir, Durable: true,
		Server:     &harness.Server{AdminURL: pair.Primary().URL("postgres"), Desc: "pgha pair"},
		ServiceURL: pair.MultiHostURLFor, Log: r.logf})
	r.mu.Lock()
	r.f = f
	r.mu.Unlock()
	defer func() {
		f.Sup.Stop()
		if f.DB != nil {
			f.DB.Pool.Close() // the database goes with the pair
		}
		if f.Dir != "" && !r.c.keep {
			os.RemoveAll(f.Dir)
		} else if f.Dir != "" {
			r.logf("logs kept in %s", f.Dir)
		}
	}()
	if err != nil {
		return nil, fmt.Errorf("start the control plane: %w", err)
	}
	w2, err := f.StartService(ctx, "worker", "worker-2", r.c.timings.CoordArgs()...)
	if err != nil {
		return nil, fmt.Errorf("start worker-2: %w", err)
	}
	procs := []*harness.Proc{f.Worker, w2, f.Sched, f.API}
	for _, g := range f.Gateways {
		procs = append(procs, g.Proc)
	}
	for _, p := range procs {
		sr.Processes = append(sr.Processes, processResult{Name: p.Name, PID: p.Cmd.Process.Pid})
	}

	db, err := pgdb.Connect(ctx, pgdb.Config{URL: f.ServiceURL(), AppName: "dbfailover-bench", MaxConns: 6, ConnectTimeout: 2 * time.Second})
	if err != nil {
		return nil, err
	}
	defer db.Close()
	if _, err := db.Exec(ctx, leaseLog); err != nil {
		return nil, fmt.Errorf("install the lease log: %w", err)
	}

	ids, creds, err := harness.RegisterNodes(ctx, db, "node", r.c.nodes)
	if err != nil {
		return nil, err
	}
	sim := &fleet.Sim{WorkTime: 5 * time.Millisecond}
	for i := range ids {
		if _, err := sim.Add(f.Address(), ids[i], creds[i], nodev1.NodeKind_NODE_KIND_NODE); err != nil {
			return nil, err
		}
	}
	simCtx, stopSim := context.WithCancel(ctx)
	defer func() { stopSim(); sim.Wait() }()
	go sim.Start(simCtx, 0)
	if err := harness.Poll(ctx, 2*time.Minute, 50*time.Millisecond, func() bool { return sim.Connected() == len(ids) }); err != nil {
		return nil, fmt.Errorf("nodes connected: %d of %d: %w", sim.Connected(), len(ids), err)
	}
	r.logf("%d nodes connected; commands at %.0f/s through the api", len(ids), r.c.rate)

	holders := fleettest.WatchHolders(db)
	prod := startProducer(f, ids, r.c.rate)
	stopped := false
	stopLoad := func() {
		if !stopped {
			stopped = true
			prod.stop()
		}
	}
	defer stopLoad()
	if err := harness.Sleep(ctx, r.c.warmup); err != nil {
		return nil, err
	}
	rows, err := db.Query(ctx, `SELECT name FROM leases WHERE owner IS NOT NULL AND expires_at > compute_now() ORDER BY name`)
	if err != nil {
		return nil, fmt.Errorf("read the leases held: %w", err)
	}
	expected, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("read the leases held: %w", err)
	}
	sr.Leases = len(expected)
	r.logf("%d leases held; fault: %s", len(expected), r.scenario)

	faultAt := time.Now()
	switch r.scenario {
	case "outage":
		err = pair.StopPrimary(ctx, false)
		if err == nil {
			err = harness.Sleep(ctx, r.c.outage)
		}
		if err == nil {
			// Back once it accepts connections; the standby reconnects on
			// its own (until then synchronous commits wait for it).
			err = pair.Primary().Start(ctx)
		}
	case "restart":
		err = pair.StopPrimary(ctx, false)
		if err == nil {
			err = pair.Primary().Start(ctx)
		}
	default:
		if r.scenario == "promote-async" && r.c.asyncLag > 0 {
			// Replication lag made visible: the standby receives nothing
			// for the last asyncLag before the crash.
			if err = pair.PauseReplication(ctx); err == nil {
				err = harness.Sleep(ctx, r.c.asyncLag)
			}
			faultAt = time.Now()
			if err != nil {
				return sr, fmt.Errorf("pause replication: %w", err)
			}
		}
		err = pair.KillPrimary(ctx)
		if err == nil {
			err = pair.Promote(ctx)
		}
	}
	if err != nil {
		return sr, fmt.Errorf("fault: %w", err)
	}
	back := time.Now()
	sr.Down = back.Sub(faultAt).Seconds()
	r.logf("database back after %.1fs; waiting for every lease", sr.Down)

	err = harness.Poll(ctx, r.c.recoverTimeout, 100*time.Millisecond, func() bool {
		n, err := countHeld(ctx, db, expected, back)
		return err == nil && n == len(expected)
	})
	if err != nil {
		n, _ := countHeld(ctx, db, expected, back)
		sr.Error = fmt.Sprintf("only %d of %d leases held again after %s", n, len(expected), r.c.recoverTimeout)
	} else {
		sr.LeasesBack = time.Since(back).Seconds()
	}
	readyErr := harness.Poll(ctx, r.c.recoverTimeout, 100*time.Millisecond, func() bool {
		for _, p := range procs {
			if code, _, err := p.Get(ctx, "/readyz"); p.Exited() || err != nil || code != 200 {
				return false
			}
		}
		return true
	})
	if readyErr == nil {
		sr.ReadyBack = time.Since(back).Seconds()
	}
	sr.NodesBack, sr.NodesAfterReady = -1, -1
	if harness.Poll(ctx, r.c.recoverTimeout, 20*time.Millisecond, func() bool { return sim.Connected() == len(ids) }) == nil {
		sr.NodesBack = time.Since(back).Seconds()
		if readyErr == nil {
			sr.NodesAfterReady = max(0, sr.NodesBack-sr.ReadyBack)
		}
	}
	r.logf("every lease held %.1fs after the database was back; every process ready after %.1fs; every node connected after %.1fs",
		sr.LeasesBack, sr.ReadyBack, sr.NodesBack)
	_ = harness.Sleep(ctx, r.c.after)
	stopLoad()

	acked, failed := prod.results()
	sr.Acknowledged, sr.CreateFailed = len(acked), failed
	r.logf("%d commands acknowledged (%d create calls failed); waiting for them to complete", len(acked), failed)
	// Acknowledged commands missing from the table (lost with an
	// asynchronous primary) never complete: wait for the others.
	if harness.Poll(ctx, 3*time.Minute, 200*time.Millisecond, func() bool {
		n, err := countCompleted(ctx, db, acked)
		present, err2 := countPresent(ctx, db, acked)
		return err == nil && err2 == nil && n == present
	}) == nil {
		sr.CompletedBack = time.Since(back).Seconds()
	}
	sr.Completed, _ = countCompleted(ctx, db, acked)
	present, _ := countPresent(ctx, db, acked)
	sr.Lost = len(acked) - sr.Completed
	sr.LostAbsent = len(acked) - present
	sr.Executions = sim.Executions.Load()
	sr.Duplicates = sim.Duplicates.Load()

	bad, pairs := holders.Stop()
	sr.HolderPairsSeen = pairs
	sr.TwoHoldersSeen = bad
	if err := db.QueryRow(ctx, sameEpochSQL).Scan(&sr.LogSameEpochTwoOwners); err != nil {
		return sr, fmt.Errorf("lease log: %w", err)
	}
	if err := db.QueryRow(ctx, overlapSQL).Scan(&sr.LogOverlaps); err != nil {
		return sr, fmt.Errorf("lease log: %w", err)
	}
	if err := db.QueryRow(ctx, `SELECT count(*) FROM bench_lease_log`).Scan(&sr.LogRows); err != nil {
		return sr, fmt.Errorf("lease log: %w", err)
	}
	for i, p := range procs {
		sr.Processes[i].Exited = p.Exited()
		if p.Exited() {
			sr.Restarted++
			sr.Processes[i].Tail = lastLines(p.Tail(), 5)
		}
	}
	r.logf("done: lost %d, duplicates %d, exited %d, two holders %d", sr.Lost, sr.Duplicates, sr.Restarted, len(bad))
	return sr, nil
}

// countHeld counts the leases of names held now and renewed or taken since
// the instant back: a lease whose pre-fault grant is merely still valid does
// not count. (compute_now() is the local clock here: the database runs on
// this machine and no scaled clock is installed.)
func countHeld(ctx context.Context, db *pgxpool.Pool, names []string, back time.Time) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	var n int
	err := db.QueryRow(ctx, `SELECT count(*) FROM leases l WHERE l.name = ANY($1) AND l.owner IS NOT NULL AND l.expires_at > compute_now()
		AND EXISTS (SELECT 1 FROM bench_lease_log g WHERE g.name = l.name AND g.owner IS NOT NULL AND g.at >= $2)`, names, back).Scan(&n)
	return n, err
}

func countCompleted(ctx context.Context, db *pgxpool.Pool, ids []string) (int, error) {
	var n int
	err := db.QueryRow(ctx, `SELECT count(*) FROM commands WHERE id = ANY($1) AND state IN ('succeeded', 'failed')`, ids).Scan(&n)
	return n, err
}

func countPresent(ctx context.Context, db *pgxpool.Pool, ids []string) (int, error) {
	var n int
	err := db.QueryRow(ctx, `SELECT count(*) FROM commands WHERE id = ANY($1)`, ids).Scan(&n)
	return n, err
}

// producer creates commands for random nodes through the api at a rate.
type producer struct {
	mu     sync.Mutex
	acked  []string
	failed int
	cancel context.CancelFunc
	done   chan struct{}
}

func startProducer(f *fleet.Fleet, ids []string, rate float64) *producer {
	ctx, cancel := context.WithCancel(context.Background())
	p := &producer{cancel: cancel, done: make(chan struct{})}
	client := f.ControlClient()
	go func() {
		defer close(p.done)
		var wg sync.WaitGroup
		defer wg.Wait()
		tick := time.NewTicker(time.Duration(float64(time.Second) / rate))
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			node := ids[rand.IntN(len(ids))]
			wg.Add(1)
			go func() {
				defer wg.Done()
				cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
				defer ccancel()
				resp, err := client.CreateCommand(cctx, connect.NewRequest(&controlv1.CreateCommandRequest{
					NodeId: node, Kind: "bench.echo", Payload: []byte("x")}))
				p.mu.Lock()
				defer p.mu.Unlock()
				if err != nil {
					if !errors.Is(err, context.Canceled) {
						p.failed++
					}
					return
				}
				p.acked = append(p.acked, resp.Msg.GetCommand().GetId())
			}()
		}
	}()
	return p
}

func (p *producer) stop() {
	p.cancel()
	<-p.done
}

func (p *producer) results() (acked []string, failed int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.acked...), p.failed
}
