package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/leasehold/leasehold/bench/internal/harness"
	"github.com/leasehold/leasehold/pkg/netns"
)

type bench struct {
	c      config
	sup    *harness.Supervisor
	dir    string
	worker string
	rclBin string
	srv    *harness.Server
	lh     *harness.Database
	rv     *harness.Database
	ns     *netns.Namespace // the vanish scenario's namespace, or nil
	seq    int
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s  %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
}

func (b *bench) run(ctx context.Context) (*result, error) {
	var err error
	if b.dir, err = os.MkdirTemp("", "leasehold-leasefailover-"); err != nil {
		return nil, err
	}
	b.sup.LogDir = b.dir
	defer func() {
		b.sup.Stop()
		if b.lh != nil {
			b.lh.Drop()
		}
		if b.rv != nil {
			b.rv.Drop()
		}
		if b.srv != nil {
			b.srv.Stop()
		}
		if b.c.keep {
			logf("logs kept in %s", b.dir)
		} else {
			os.RemoveAll(b.dir)
		}
	}()
	logf("building leasehold-worker and riverclient")
	bins, err := harness.Binaries(b.dir, b.c.binDir, "worker")
	if err != nil {
		return nil, err
	}
	b.worker = bins["worker"]
	if b.c.river {
		b.rclBin = filepath.Join(b.dir, "riverclient")
		if err := harness.GoBuild(filepath.Join(harness.RepoRoot(), "bench", "cmd", "riverclient"), b.rclBin); err != nil {
			return nil, err
		}
	}
	var listen, hostAuth []string
	if slices.Contains(b.c.scenarios, "vanish") {
		if b.ns, err = b.vanishNamespace(ctx); err != nil {
			logf("leasehold vanish: skipped: %v", err)
			b.c.scenarios = slices.DeleteFunc(b.c.scenarios, func(s string) bool { return s == "vanish" })
		} else {
			defer b.ns.Close()
			listen, hostAuth = []string{b.ns.HostAddr}, []string{b.ns.Subnet}
		}
	}
	if b.srv, err = harness.StartServerOn(ctx, b.c.durable, listen, hostAuth); err != nil {
		return nil, err
	}
	if b.lh, err = b.srv.CreateDatabase(ctx, "leasefailover"); err != nil {
		return nil, err
	}
	r := &result{Machine: harness.Host(), Database: b.srv.Desc, Date: time.Now().UTC().Format(time.RFC3339), Runs: b.c.runs,
		Timings:   "defaults on both sides: leasehold shard/singleton TTL 15 s, renew 5 s, tick 1 s; River elect interval 5 s (+0-1 s jitter), leader TTL 15 s (River's defaults, not configurable through river.Config)",
		Leasehold: map[string]*scenarioResult{}, River: map[string]*scenarioResult{}}
	if b.c.river {
		if b.rv, err = b.srv.CreateDatabase(ctx, "river"); err != nil {
			return nil, err
		}
		migrator, err := rivermigrate.New(riverpgxv5.New(b.rv.Pool), &rivermigrate.Config{Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			return nil, err
		}
		if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
			return nil, fmt.Errorf("river migrate: %w", err)
		}
	}
	for _, s := range b.c.scenarios {
		if s == "vanish" {
			sr, err := b.vanish(ctx)
			if err != nil {
				return nil, fmt.Errorf("leasehold vanish: %w", err)
			}
			r.Leasehold[s] = sr
			continue
		}
		sr, err := b.leasehold(ctx, s)
		if err != nil {
			return nil, fmt.Errorf("leasehold %s: %w", s, err)
		}
		r.Leasehold[s] = sr
		if b.c.river && (s == "crash" || s == "sigterm") {
			rr, err := b.riverScenario(ctx, s)
			if err != nil {
				return nil, fmt.Errorf("river %s: %w", s, err)
			}
			r.River[s] = rr
		}
	}
	for _, live := range b.c.loadLiveness {
		for _, m := range b.c.members {
			lr, err := b.load(ctx, m, live)
			if err != nil {
				return nil, fmt.Errorf("load %d: %w", m, err)
			}
			r.Load = append(r.Load, lr)
		}
	}
	r.judge()
	return r, nil
}

// ---- leasehold ----

func (b *bench) startWorker(ctx context.Context, extra ...string) (*harness.Proc, string, error) {
	b.seq++
	id := fmt.Sprintf("w%d", b.seq)
	args := append([]string{"--database-url", b.lh.URL, "--http-addr", harness.FreeAddr(), "--id", id,
		"--log-format", "text", "--log-level", "warn"}, extra...)
	p, err := b.sup.Start(id, b.worker, nil, args...)
	if err != nil {
		return nil, "", err
	}
	return p, id, p.WaitReady(ctx, 60*time.Second)
}

func (b *bench) held(ctx context.Context, owner string) (map[string]bool, error) {
	rows, err := b.lh.Pool.Query(ctx, `SELECT name /*bench*/ FROM leases WHERE owner = $1 AND expires_at > compute_now()`, owner)
	if err != nil {
		return nil, err
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	m := map[string]bool{}
	for _, n := range names {
		m[n] = true
	}
	return m, err
}

func shards(m map[string]bool) int {
	k := 0
	for n := range m {
		if strings.HasPrefix(n, "shard:") {
			k++
		}
	}
	return k
}

// settle waits until a and b between them hold every live lease and the
// split has not changed for 2 s.
func (b *bench) settle(ctx context.Context, a, peer string) (map[string]bool, error) {
	deadline := time.Now().Add(45 * time.Second)
	var last string
	stableSince := time.Now()
	for time.Now().Before(deadline) {
		ha, err := b.held(ctx, a)
		if err != nil {
			return nil, err
		}
		hb, err := b.held(ctx, peer)
		if err != nil {
			return nil, err
		}
		key := fmt.Sprintf("%d/%d", len(ha), len(hb))
		if key != last {
			last, stableSince = key, time.Now()
		}
		if shards(ha)+shards(hb) == 256 && len(hb) > 0 && time.Since(stableSince) > 2*time.Second {
			return ha, nil
		}
		if err := harness.Sleep(ctx, 250*time.Millisecond); err != nil {
			return nil, err
		}
	}
	return nil, fmt.Errorf("workers %s and %s did not settle (last split %s)", a, peer, last)
}

func (b *bench) leasehold(ctx context.Context, scenario string) (*scenarioResult, error) {
	logf("leasehold %s: %d runs", scenario, b.c.runs)
	// crash-ttl is the crash with liveness sessions off: the TTL path alone,
	// as behind a transaction pooler without a direct URL.
	var extra []string
	if scenario == "crash-ttl" {
		extra = []string{"--coord.liveness=false"}
	}
	holder, hid, err := b.startWorker(ctx, extra...)
	if err != nil {
		return nil, err
	}
	// The first worker alone takes all 256 shards and every singleton.
	if err := waitFor(ctx, 60*time.Second, func() bool { h, _ := b.held(ctx, hid); return shards(h) == 256 }); err != nil {
		return nil, fmt.Errorf("first worker never held 256 shards: %w", err)
	}
	sr := &scenarioResult{}
	for i := range b.c.runs {
		peer, pid, err := b.startWorker(ctx, extra...)
		if err != nil {
			return nil, err
		}
		victimHeld, err := b.settle(ctx, hid, pid)
		if err != nil {
			return nil, err
		}
		sr.LeasesMoved = append(sr.LeasesMoved, len(victimHeld))
		t0 := time.Now()
		stopKilling := func() {}
		if scenario == "conn-killed" {
			// The process lives; every one of its database sessions is
			// terminated from the server side, again and again, until the
			// survivor holds its leases.
			kctx, cancel := context.WithCancel(ctx)
			done := make(chan struct{})
			go func() { defer close(done); b.terminateUntil(kctx, hid) }()
			stopKilling = func() { cancel(); <-done }
		} else {
			sig := map[string]syscall.Signal{"crash": syscall.SIGKILL, "crash-ttl": syscall.SIGKILL, "pause": syscall.SIGSTOP, "sigterm": syscall.SIGTERM}[scenario]
			if err := holder.Signal(sig); err != nil {
				return nil, err
			}
		}
		var took time.Duration
		err = waitForFast(ctx, 60*time.Second, func() bool {
			h, err := b.held(ctx, pid)
			if err != nil {
				return false
			}
			for n := range victimHeld {
				if !h[n] {
					return false
				}
			}
			took = time.Since(t0)
			return true
		})
		stopKilling()
		if err != nil {
			return nil, fmt.Errorf("run %d: %s never took %d leases over: %w", i+1, pid, len(victimHeld), err)
		}
		sr.Takeovers = append(sr.Takeovers, took)
		logf("leasehold %s run %d/%d: %s held %d leases (%d shards) of %s after %s", scenario, i+1, b.c.runs, pid,
			len(victimHeld), shards(victimHeld), hid, took.Round(time.Millisecond))
		switch scenario {
		case "conn-killed":
			_ = holder.Signal(syscall.SIGTERM)
			if _, ok := holder.Wait(60 * time.Second); !ok {
				holder.Kill()
			}
			if _, err := b.lh.Pool.Exec(ctx, `DELETE FROM workers WHERE id = $1 /*bench*/`, hid); err != nil {
				return nil, err
			}
		case "crash", "crash-ttl":
			// Bench hygiene: forget the dead member at once instead of the
			// 10 min the janitor waits, so every run starts alike.
			if _, err := b.lh.Pool.Exec(ctx, `DELETE FROM workers WHERE id = $1 /*bench*/`, hid); err != nil {
				return nil, err
			}
		case "pause":
			_ = holder.Signal(syscall.SIGCONT)
			_ = holder.Signal(syscall.SIGTERM)
			if _, ok := holder.Wait(60 * time.Second); !ok {
				holder.Kill()
			}
		case "sigterm":
			if code, ok := holder.Wait(60 * time.Second); !ok || code != 0 {
				sr.BadExits++
			}
		}
		holder, hid = peer, pid
	}
	_ = holder.Signal(syscall.SIGTERM)
	if _, ok := holder.Wait(60 * time.Second); !ok {
		holder.Kill()
	}
	if _, err := b.lh.Pool.Exec(ctx, `DELETE FROM workers /*bench*/`); err != nil {
		return nil, err
	}
	sr.Dist = harness.Summarize(sr.Takeovers)
	return sr, nil
}

// ---- River ----

type riverProc struct {
	p      *harness.Proc
	id     string
	leader chan time.Time
	start  chan struct{}
}

func (b *bench) startRiver(ctx context.Context, mode string) (*riverProc, error) {
	b.seq++
	rp := &riverProc{id: fmt.Sprintf("river-%d", b.seq), leader: make(chan time.Time, 1), start: make(chan struct{})}
	var once sync.Once
	p, err := b.sup.StartLines(rp.id, b.rclBin, nil, func(line string) {
		if ns, ok := strings.CutPrefix(line, "LEADER "); ok {
			n, _ := strconv.ParseInt(ns, 10, 64)
			select {
			case rp.leader <- time.Unix(0, n):
			default:
			}
		}
		if line == "STARTED" {
			once.Do(func() { close(rp.start) })
		}
	}, "-database-url", b.rv.URL, "-id", rp.id, "-mode", mode)
	if err != nil {
		return nil, err
	}
	rp.p = p
	select {
	case <-rp.start:
		return rp, nil
	case <-p.Done():
		return nil, fmt.Errorf("riverclient exited: %s", p.Tail())
	case <-time.After(30 * time.Second):
		return nil, errors.New("riverclient did not start")
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (b *bench) riverLeader(ctx context.Context) string {
	var id string
	_ = b.rv.Pool.QueryRow(ctx, `SELECT leader_id /*bench*/ FROM river_leader WHERE expires_at > now()`).Scan(&id)
	return id
}

func (b *bench) riverScenario(ctx context.Context, scenario string) (*scenarioResult, error) {
	logf("river %s: %d runs", scenario, b.c.runs)
	leader, err := b.startRiver(ctx, "leader")
	if err != nil {
		return nil, err
	}
	select {
	case <-leader.leader:
	case <-time.After(60 * time.Second):
		return nil, errors.New("first River client never became leader")
	}
	sr := &scenarioResult{}
	for i := range b.c.runs {
		peer, err := b.startRiver(ctx, "leader")
		if err != nil {
			return nil, err
		}
		// Let the follower run its first election attempts (and lose).
		if err := harness.Sleep(ctx, 2*time.Second); err != nil {
			return nil, err
		}
		if got := b.riverLeader(ctx); got != leader.id {
			return nil, fmt.Errorf("leader is %q, want %s", got, leader.id)
		}
		sig := map[string]syscall.Signal{"crash": syscall.SIGKILL, "sigterm": syscall.SIGTERM}[scenario]
		t0 := time.Now()
		if err := leader.p.Signal(sig); err != nil {
			return nil, err
		}
		rowCh := make(chan time.Duration, 1)
		go func() {
			_ = waitForFast(ctx, 60*time.Second, func() bool {
				if b.riverLeader(ctx) == peer.id {
					rowCh <- time.Since(t0)
					return true
				}
				return false
			})
		}()
		select {
		case at := <-peer.leader:
			sr.Takeovers = append(sr.Takeovers, at.Sub(t0))
			logf("river %s run %d/%d: %s leader-only work started %s after the %s", scenario, i+1, b.c.runs, peer.id,
				at.Sub(t0).Round(time.Millisecond), scenario)
		case <-time.After(60 * time.Second):
			return nil, fmt.Errorf("run %d: survivor never became leader", i+1)
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		select {
		case d := <-rowCh:
			sr.RowTakeovers = append(sr.RowTakeovers, d)
		case <-time.After(5 * time.Second):
		}
		if code, ok := leader.p.Wait(30 * time.Second); scenario == "sigterm" && (!ok || code != 0) {
			sr.BadExits++
		}
		leader = peer
	}
	_ = leader.p.Signal(syscall.SIGTERM)
	leader.p.Wait(30 * time.Second)
	sr.Dist = harness.Summarize(sr.Takeovers)
	sr.RowDist = harness.Summarize(sr.RowTakeovers)
	return sr, nil
}

// ---- coordination load ----

func (b *bench) load(ctx context.Context, members int, liveness bool) (loadResult, error) {
	logf("coordination load: %d members, liveness %v", members, liveness)
	var procs []*harness.Proc
	defer func() {
		for _, p := range procs {
			_ = p.Signal(syscall.SIGTERM)
		}
		for _, p := range procs {
			if _, ok := p.Wait(60 * time.Second); !ok {
				p.Kill()
			}
		}
		_, _ = b.lh.Pool.Exec(context.Background(), `DELETE FROM workers /*bench*/`)
	}()
	for range members {
		b.seq++
		id := fmt.Sprintf("w%d", b.seq)
		p, err := b.sup.Start(id, b.worker, nil, "--database-url", b.lh.URL, "--http-addr", harness.FreeAddr(), "--id", id,
			"--log-format", "text", "--log-level", "warn", "--db-max-conns", "4", fmt.Sprintf("--coord.liveness=%v", liveness))
		if err != nil {
			return loadResult{}, err
		}
		procs = append(procs, p)
	}
	for _, p := range procs {
		if err := p.WaitReady(ctx, 120*time.Second); err != nil {
			return loadResult{}, err
		}
	}
	if err := harness.Sleep(ctx, b.c.loadSettle); err != nil {
		return loadResult{}, err
	}
	if err := b.lh.ResetStatements(ctx); err != nil {
		return loadResult{}, err
	}
	x0, _ := b.lh.Xacts(ctx)
	t0 := time.Now()
	if err := harness.Sleep(ctx, b.c.loadWindow); err != nil {
		return loadResult{}, err
	}
	st, err := b.lh.Statements(ctx)
	if err != nil {
		return loadResult{}, err
	}
	x1, _ := b.lh.Xacts(ctx)
	el := time.Since(t0).Seconds()
	var live int
	_ = b.lh.Pool.QueryRow(ctx, `SELECT count(*) /*bench*/ FROM leases WHERE expires_at > compute_now() AND name LIKE 'shard:%'`).Scan(&live)
	lr := loadResult{Members: members, Liveness: liveness, Window: el, Statements: st, StatementsPerSec: float64(st) / el,
		PerMember: float64(st) / el / float64(members), XactsPerSec: float64(x1-x0) / el, ShardsHeld: live}
	logf("  %d members, liveness %v: %.1f statements/s (%.2f per member), %.1f xact/s", members, liveness, lr.StatementsPerSec, lr.PerMember, lr.XactsPerSec)
	return lr, nil
}

func waitFor(ctx context.Context, timeout time.Duration, cond func() bool) error {
	return harness.Poll(ctx, timeout, 100*time.Millisecond, cond)
}

func waitForFast(ctx context.Context, timeout time.Duration, cond func() bool) error {
	return harness.Poll(ctx, timeout, 10*time.Millisecond, cond)
}

// terminateUntil terminates every database session of worker id (its pool,
// LISTEN and liveness sessions) every 50 ms until ctx ends.
func (b *bench) terminateUntil(ctx context.Context, id string) {
	for ctx.Err() == nil {
		_, _ = b.lh.Pool.Exec(ctx, `SELECT pg_terminate_backend(pid) /*bench*/ FROM pg_stat_activity
			WHERE application_name LIKE '%' || $1 AND pid <> pg_backend_pid()`, ":"+id)
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}
