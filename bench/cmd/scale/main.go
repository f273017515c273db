// Command scale is the scale model of one PostgreSQL primary: what N idle
// connected nodes, and the same N nodes with a steady command rate, cost
// the database, and how many nodes a primary of a given size therefore
// holds.
//
// It starts the real control plane on one PostgreSQL server (gateways
// behind HAProxy, a worker, a scheduler; the api with -producer api) and
// grows one fleet of simulated nodes step by step (-nodes 1000,5000,10000),
// each node in a nodesim process of its own (at most -nodes-per-process in
// one). At each step, once every node has a session and -warmup has passed,
// it measures over -window:
//
//   - idle: PostgreSQL CPU seconds per second (the postmaster and all its
//     processes, from /proc), statements/s (pg_stat_statements, the bench's
//     own left out), commits/s (pg_stat_database), WAL bytes/s (pg_stat_wal)
//     and the connections the services hold (pg_stat_activity);
//   - commands: the same with -per-node-per-minute commands per node per
//     minute (N/60 per second by default, one INSERT each with -producer
//     sql, as throughput's sql producer), plus completed commands/s and
//     create-to-done p50/p99 of the commands created in the window.
//
// It then fits a line to each phase's PostgreSQL CPU over N (least squares)
// and extrapolates, linearly, the nodes a primary of C cores holds with
// PostgreSQL at -headroom of its cores (50%: half the cores kept free).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/bench/internal/fleet"
	"github.com/leasehold/leasehold/bench/internal/harness"
)

type config struct {
	nodes                   []int
	gateways, perProcess    int
	helloRate, creators     int
	perNodePerMinute        float64
	headroom                float64
	cores                   []int
	warmup, window, drain   time.Duration
	commandWarmup, loadWait time.Duration
	maxLoad                 float64
	producer, jsonPath, bin string
	durable, commands       bool
	gatewayArgs             []string
}

// phase is one measuring window at one fleet size.
type phase struct {
	// PGCPU is PostgreSQL's CPU seconds per second (all its processes).
	PGCPU        float64       `json:"pg_cpu_s_per_s"`
	Statements   float64       `json:"statements_per_s"`
	Commits      float64       `json:"commits_per_s"`
	WALBytes     float64       `json:"wal_bytes_per_s"`
	RowWrites    float64       `json:"row_writes_per_s"`
	ConnsMean    float64       `json:"connections_mean"`
	ConnsMax     int           `json:"connections_max"`
	ActiveMean   float64       `json:"connections_active_mean"`
	Offered      float64       `json:"offered_commands_per_s,omitempty"`
	CreatedPS    float64       `json:"created_per_s,omitempty"`
	CompletedPS  float64       `json:"completed_per_s,omitempty"`
	Latency      *harness.Dist `json:"create_to_done,omitempty"`
	Unfinished   int64         `json:"unfinished_after_drain,omitempty"`
	CreateErrors int64         `json:"create_errors,omitempty"`
	// Connected is the nodes with a session at the window's end, as the
	// nodesim processes and node_sessions count them.
	Connected   int   `json:"connected_nodes"`
	DBConnected int64 `json:"connected_sessions_in_db"`
	// Hellos is the sessions opened in the window (the rise of the sum of
	// node_sessions.session_epoch, which every Hello bumps): a fleet at
	// rest opens none; each one costs a Hello's writes.
	Hellos    int64                   `json:"hellos_in_window"`
	Costliest []harness.StatementCost `json:"costliest_statements,omitempty"`
	Load      string                  `json:"load_average"`
	LoadStart string                  `json:"load_average_at_start"`
	Start     string                  `json:"start"`
}

type step struct {
	Nodes    int    `json:"nodes"`
	Idle     phase  `json:"idle"`
	Commands *phase `json:"commands,omitempty"`
}

// fit is PostgreSQL CPU = Fixed + PerThousand * N/1000, least squares.
type fit struct {
	Fixed       float64 `json:"fixed_pg_cpu_s_per_s"`
	PerThousand float64 `json:"pg_cpu_s_per_s_per_1000_nodes"`
	// The same fit of statements/s, commits/s and WAL bytes/s: per 1,000 nodes.
	StatementsPerThousand float64 `json:"statements_per_s_per_1000_nodes"`
	CommitsPerThousand    float64 `json:"commits_per_s_per_1000_nodes"`
	WALPerThousand        float64 `json:"wal_bytes_per_s_per_1000_nodes"`
	// Capacity is the nodes at which the line reaches headroom of each
	// primary size's cores (a linear extrapolation); empty when the line
	// does not rise with the nodes.
	Capacity []capacity `json:"capacity"`
}

type capacity struct {
	Cores int     `json:"cores"`
	Nodes float64 `json:"nodes"`
}

type result struct {
	Machine          string   `json:"machine"`
	Database         string   `json:"database"`
	Date             string   `json:"date"`
	Command          string   `json:"command"`
	Gateways         int      `json:"gateways"`
	Producer         string   `json:"producer"`
	PerNodePerMinute float64  `json:"commands_per_node_per_minute"`
	Warmup           float64  `json:"warmup_s"`
	Window           float64  `json:"window_s"`
	Headroom         float64  `json:"headroom_fraction_of_cores"`
	GatewayArgs      []string `json:"gateway_args,omitempty"`
	NoFile           uint64   `json:"rlimit_nofile"`
	Steps            []step   `json:"steps"`
	Idle             *fit     `json:"fit_idle,omitempty"`
	Commands         *fit     `json:"fit_commands,omitempty"`
	Note             string   `json:"note"`
}

// logf is harness.Logf.
var logf = harness.Logf

func main() {
	var c config
	var nodes, cores string
	var quick bool
	flag.StringVar(&nodes, "nodes", "1000,5000,10000", "fleet sizes, measured in increasing order on one growing fleet")
	flag.IntVar(&c.gateways, "gateways", 3, "gateways behind HAProxy")
	flag.IntVar(&c.perProcess, "nodes-per-process", 5000, "simulated nodes per nodesim process at most")
	flag.IntVar(&c.helloRate, "hello-rate", 0, "nodes started per second in all (0: 150 per gateway, under the gateways' 200/s admission buckets)")
	flag.Float64Var(&c.perNodePerMinute, "per-node-per-minute", 1, "commands phase: commands per node per minute (N*this/60 per second)")
	flag.IntVar(&c.creators, "creators", 8, "commands phase: concurrent creators taking the paced commands")
	flag.BoolVar(&c.commands, "commands", true, "measure the commands phase after each idle one")
	flag.DurationVar(&c.warmup, "warmup", 20*time.Second, "after every node has a session, wait this long before the idle window")
	flag.DurationVar(&c.commandWarmup, "command-warmup", 10*time.Second, "commands phase: create commands this long before its window")
	flag.DurationVar(&c.window, "window", 30*time.Second, "measuring window of each phase")
	flag.DurationVar(&c.drain, "drain", 30*time.Second, "commands phase: after the window, wait this long at most for the commands created to finish")
	flag.Float64Var(&c.maxLoad, "max-load", 3, "before each window, wait (up to -load-wait) for the 1-minute load average to fall to this (0: never wait)")
	flag.DurationVar(&c.loadWait, "load-wait", 2*time.Minute, "the longest wait for -max-load; the window then starts anyway, its load recorded")
	flag.Float64Var(&c.headroom, "headroom", 0.5, "capacity: the fraction of a primary's cores PostgreSQL may use")
	flag.StringVar(&cores, "cores", "", "capacity: primary sizes in cores (default: this machine's, 8, 16, 32)")
	flag.StringVar(&c.producer, "producer", "sql", "commands: sql (one INSERT each, then a coalesced wake-up) or api (ControlService.CreateCommand)")
	flag.StringVar(&c.jsonPath, "json", "", "write the result as JSON to this file")
	flag.StringVar(&c.bin, "bin", "", "use prebuilt leasehold-<service> binaries from this directory (default: build)")
	flag.BoolVar(&c.durable, "durable", true, "local PostgreSQL with fsync and synchronous_commit on")
	flag.BoolVar(&quick, "quick", false, "smoke run: -nodes 100,300 -warmup 3s -command-warmup 2s -window 5s -drain 10s (flags given explicitly win)")
	flag.Func("gateway-arg", "an extra gateway flag, e.g. --gateway.max-streams=8000 (repeatable)", func(v string) error {
		c.gatewayArgs = append(c.gatewayArgs, v)
		return nil
	})
	flag.Parse()
	if quick {
		set := map[string]bool{}
		flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
		for name, v := range map[string]string{"nodes": "100,300", "warmup": "3s", "command-warmup": "2s", "window": "5s", "drain": "10s"} {
			if !set[name] {
				_ = flag.Set(name, v)
			}
		}
	}
	var err error
	if c.nodes, err = ints(nodes); err != nil || len(c.nodes) == 0 {
		fmt.Fprintf(os.Stderr, "scale: bad -nodes %q\n", nodes)
		os.Exit(2)
	}
	slices.Sort(c.nodes)
	c.nodes = slices.Compact(c.nodes)
	if cores == "" {
		cores = fmt.Sprintf("%d,8,16,32", runtime.NumCPU())
	}
	if c.cores, err = ints(cores); err != nil {
		fmt.Fprintf(os.Stderr, "scale: bad -cores %q\n", cores)
		os.Exit(2)
	}
	if c.producer != "sql" && c.producer != "api" {
		fmt.Fprintf(os.Stderr, "scale: -producer is sql or api, not %q\n", c.producer)
		os.Exit(2)
	}
	if c.helloRate <= 0 {
		c.helloRate = 150 * c.gateways
	}
	sup := &harness.Supervisor{}
	var mu sync.Mutex
	var fl *fleet.Fleet
	ctx, cancel := harness.SignalContext(func() {
		sup.Stop()
		mu.Lock()
		if fl != nil {
			fl.Sup.Stop()
		}
		mu.Unlock()
	})
	defer cancel()
	res, err := run(ctx, c, sup, func(f *fleet.Fleet) { mu.Lock(); fl = f; mu.Unlock() })
	if res != nil && len(res.Steps) > 0 {
		res.print(os.Stdout)
		if werr := harness.WriteJSON(c.jsonPath, res); werr != nil {
			fmt.Fprintln(os.Stderr, "scale: write json:", werr)
			os.Exit(2) // -json was asked for and not written
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "scale:", err)
		os.Exit(2)
	}
}

func ints(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		var n int
		if _, err := fmt.Sscan(strings.TrimSpace(f), &n); err != nil || n < 1 {
			return nil, fmt.Errorf("bad %q", f)
		}
		out = append(out, n)
	}
	return out, nil
}

func run(ctx context.Context, c config, sup *harness.Supervisor, started func(*fleet.Fleet)) (*result, error) {
	maxN := slices.Max(c.nodes)
	nofile, err := harness.RaiseNoFile(uint64(4*maxN + 4096))
	if err != nil {
		logf("raise RLIMIT_NOFILE: %v", err)
	}
	logf("RLIMIT_NOFILE %d (inherited by the gateways, HAProxy and nodesim)", nofile)
	gwArgs := slices.Clone(c.gatewayArgs)
	// A gateway takes at most 5,000 streams by default; size it for its
	// share of the largest fleet plus half as much again (leastconn
	// spreads unevenly while nodes arrive), unless told otherwise.
	if share := (maxN*3/2 + c.gateways - 1) / c.gateways; share > 5000 && !slices.ContainsFunc(gwArgs, func(a string) bool {
		return strings.HasPrefix(a, "--gateway.max-streams")
	}) {
		gwArgs = append(gwArgs, fmt.Sprintf("--gateway.max-streams=%d", share))
	}
	logf("starting PostgreSQL")
	srv, err := harness.StartServer(ctx, c.durable)
	if err != nil {
		return nil, err
	}
	defer srv.Stop()
	defer sup.Stop()
	r := &result{Machine: harness.Host(), Database: srv.Desc, Date: time.Now().UTC().Format(time.RFC3339),
		Command: strings.TrimSpace("scale " + strings.Join(os.Args[1:], " ")), Gateways: c.gateways, Producer: c.producer, PerNodePerMinute: c.perNodePerMinute,
		Warmup: c.warmup.Seconds(), Window: c.window.Seconds(), Headroom: c.headroom, GatewayArgs: gwArgs, NoFile: nofile,
		Note: "capacity is a linear extrapolation of the fitted PostgreSQL CPU line beyond the fleet sizes measured; the simulated nodes, gateways and HAProxy share the machine with PostgreSQL"}
	f, err := fleet.Start(ctx, fleet.Options{Gateways: c.gateways, Timings: fleet.Real, NoAPI: c.producer != "api",
		MaxConns: maxN + 100, BinDir: c.bin, Server: srv, Durable: c.durable, Log: logf, GatewayArgs: gwArgs})
	started(f)
	defer f.Close(false)
	if err != nil {
		return r, err
	}
	dir, err := os.MkdirTemp("", "leasehold-scale-nodes-")
	if err != nil {
		return r, err
	}
	defer os.RemoveAll(dir)
	bin, err := fleet.BuildNodesim(dir)
	if err != nil {
		return r, err
	}
	var (
		procs []*fleet.NodeProcess
		ids   []string
	)
	defer func() {
		for _, p := range procs {
			p.Stop()
		}
	}()
	connected := func() int {
		n := 0
		for _, p := range procs {
			n += p.Connected()
		}
		return n
	}
	prod := f.NewProducer(c.producer == "api")
	defer prod.Close()
	for si, n := range c.nodes {
		// Register and start the nodes this step adds, in processes of at
		// most perProcess nodes; the last process of the previous step is
		// not topped up (a process's node list is fixed at its start).
		add := n - len(ids)
		newIDs, creds, err := harness.RegisterNodes(ctx, f.DB.Pool, fmt.Sprintf("s%d", si), add)
		if err != nil {
			return r, err
		}
		chunks := (add + c.perProcess - 1) / c.perProcess
		logf("%d nodes: starting %d more in %d nodesim process(es), %d Hellos/s in all", n, add, chunks, c.helloRate)
		for k := range chunks {
			lo, hi := k*c.perProcess, min(add, (k+1)*c.perProcess)
			p, err := fleet.StartNodeProcess(sup, bin, fmt.Sprintf("nodesim-%d", len(procs)+1), dir, f.Address(),
				newIDs[lo:hi], creds[lo:hi], max(1, c.helloRate/chunks))
			if err != nil {
				return r, err
			}
			procs = append(procs, p)
		}
		ids = append(ids, newIDs...)
		wait := 2*time.Minute + time.Duration(add/max(1, c.helloRate)*2)*time.Second
		if err := harness.Poll(ctx, wait, time.Second, func() bool { return connected() == n }); err != nil {
			return r, fmt.Errorf("%d nodes: %d connected: %w", n, connected(), err)
		}
		logf("%d nodes connected; warming up %s (load %s)", n, c.warmup, harness.LoadAvg())
		if err := harness.Sleep(ctx, c.warmup); err != nil {
			return r, err
		}
		st := step{Nodes: n}
		if st.Idle, err = measure(ctx, c, srv, f, connected, nil); err != nil {
			return r, err
		}
		logf("  idle: %s", st.Idle.summary())
		if c.commands {
			cp, err := commandsPhase(ctx, c, srv, f, prod, ids, connected)
			if err != nil {
				return r, err
			}
			st.Commands = &cp
			logf("  commands: %s", cp.summary())
		}
		r.Steps = append(r.Steps, st)
	}
	r.Idle = fitSteps(c, r.Steps, func(s step) *phase { return &s.Idle })
	if c.commands {
		r.Commands = fitSteps(c, r.Steps, func(s step) *phase { return s.Commands })
	}
	return r, nil
}

// cost is a cumulative sample of what PostgreSQL spent.
type cost struct {
	at                         time.Time
	cpu                        float64
	stmts, xacts, rows, walLen int64
}

func sampleCost(ctx context.Context, srv *harness.Server, db *harness.Database) (cost, error) {
	c := cost{at: time.Now()}
	var ok bool
	if c.cpu, ok = srv.CPU(); !ok {
		return c, errors.New("PostgreSQL CPU is read from /proc of a local cluster; unset LEASEHOLD_DATABASE_URL")
	}
	var errs [4]error
	c.stmts, errs[0] = db.Statements(ctx)
	c.xacts, errs[1] = db.Xacts(ctx)
	c.rows, errs[2] = db.RowWrites(ctx)
	c.walLen, errs[3] = db.WALBytes(ctx)
	return c, errors.Join(errs[:]...)
}

// conns counts the connections to the database other than the bench's
// own pool: held, and active (running a statement or in a transaction).
func conns(ctx context.Context, db *harness.Database) (held, active int, err error) {
	err = db.Pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE state <> 'idle' AND pid <> pg_backend_pid()) /*bench*/
  FROM pg_stat_activity WHERE datname = current_database()`).Scan(&held, &active)
	return held - int(db.Pool.Stat().TotalConns()), active, err
}

// measure samples PostgreSQL's costs over one window; load, when set, runs
// beside it (the commands phase) and is told the window's bounds.
func measure(ctx context.Context, c config, srv *harness.Server, f *fleet.Fleet, connected func() int, window func(start bool)) (phase, error) {
	if err := waitLoad(ctx, c); err != nil {
		return phase{}, err
	}
	p := phase{LoadStart: harness.LoadAvg(), Start: time.Now().UTC().Format(time.RFC3339)}
	if err := f.DB.ResetStatements(ctx); err != nil {
		return p, fmt.Errorf("pg_stat_statements: %w", err)
	}
	epochs := func() int64 {
		var n int64
		_ = f.DB.Pool.QueryRow(ctx, `SELECT coalesce(sum(session_epoch), 0)::bigint /*bench*/ FROM node_sessions`).Scan(&n)
		return n
	}
	e0 := epochs()
	c0, err := sampleCost(ctx, srv, f.DB)
	if err != nil {
		return p, err
	}
	if window != nil {
		window(true)
	}
	var samples, held, active int
	t := time.NewTicker(time.Second)
	end := time.After(c.window)
loop:
	for {
		select {
		case <-ctx.Done():
			t.Stop()
			return p, ctx.Err()
		case <-t.C:
			if h, a, err := conns(ctx, f.DB); err == nil {
				samples++
				held += h
				active += a
				p.ConnsMax = max(p.ConnsMax, h)
			}
		case <-end:
			break loop
		}
	}
	t.Stop()
	if window != nil {
		window(false)
	}
	c1, err := sampleCost(ctx, srv, f.DB)
	if err != nil {
		return p, err
	}
	p.Hellos = epochs() - e0
	secs := c1.at.Sub(c0.at).Seconds()
	p.PGCPU = (c1.cpu - c0.cpu) / secs
	p.Statements = float64(c1.stmts-c0.stmts) / secs
	p.Commits = float64(c1.xacts-c0.xacts) / secs
	p.RowWrites = float64(c1.rows-c0.rows) / secs
	p.WALBytes = float64(c1.walLen-c0.walLen) / secs
	if samples > 0 {
		p.ConnsMean, p.ActiveMean = float64(held)/float64(samples), float64(active)/float64(samples)
	}
	p.Connected = connected()
	_ = f.DB.Pool.QueryRow(ctx, `SELECT count(*) /*bench*/ FROM node_sessions WHERE state = 'connected'`).Scan(&p.DBConnected)
	if top, err := f.DB.CostliestStatements(ctx, 6); err == nil {
		p.Costliest = top
	}
	p.Load = harness.LoadAvg()
	return p, nil
}

// commandsPhase creates commands at N*perNodePerMinute/60 per second,
// round robin over the nodes (each node gets one every 60/perNodePerMinute
// seconds), and measures a window after commandWarmup.
func commandsPhase(ctx context.Context, c config, srv *harness.Server, f *fleet.Fleet, prod *fleet.Producer, ids []string, connected func() int) (phase, error) {
	rate := float64(len(ids)) * c.perNodePerMinute / 60
	cctx, stop := context.WithCancel(ctx)
	defer stop()
	due := make(chan string, 4*c.creators)
	var created, errs atomic.Int64
	var wg sync.WaitGroup
	for range c.creators {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for node := range due {
				rctx, cancel := context.WithTimeout(context.WithoutCancel(cctx), 10*time.Second)
				err := prod.Create(rctx, node)
				cancel()
				if err != nil {
					errs.Add(1)
					continue
				}
				created.Add(1)
			}
		}()
	}
	var dropped atomic.Int64
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(due)
		t := time.NewTicker(10 * time.Millisecond)
		defer t.Stop()
		start := time.Now()
		var sent int64
		for {
			select {
			case <-cctx.Done():
				return
			case now := <-t.C:
				for target := int64(rate * now.Sub(start).Seconds()); sent < target; sent++ {
					select {
					case due <- ids[sent%int64(len(ids))]:
					default:
						dropped.Add(1) // creators behind: the offered rate is never exceeded
					}
				}
			}
		}
	}()
	logf("  commands: %.1f/s (%g per node per minute) via %s, %s before the window", rate, c.perNodePerMinute, c.producer, c.commandWarmup)
	if err := harness.Sleep(ctx, c.commandWarmup); err != nil {
		return phase{}, err
	}
	count := func() int64 {
		var n int64
		_ = f.DB.Pool.QueryRow(ctx, `SELECT count(*) /*bench*/ FROM commands WHERE state = 'succeeded'`).Scan(&n)
		return n
	}
	var (
		done0, done1 int64
		made0, made1 int64
		from, to     time.Time
		fromDB, toDB time.Time
	)
	dbNow := func() time.Time {
		var t time.Time
		_ = f.DB.Pool.QueryRow(ctx, `SELECT clock_timestamp() /*bench*/`).Scan(&t)
		return t
	}
	p, err := measure(ctx, c, srv, f, connected, func(start bool) {
		if start {
			from, fromDB, done0, made0 = time.Now(), dbNow(), count(), created.Load()
		} else {
			to, toDB, done1, made1 = time.Now(), dbNow(), count(), created.Load()
		}
	})
	stop()
	wg.Wait()
	if err != nil {
		return p, err
	}
	secs := to.Sub(from).Seconds()
	p.Offered, p.CreatedPS, p.CompletedPS = rate, float64(made1-made0)/secs, float64(done1-done0)/secs
	p.CreateErrors = errs.Load()
	if d := dropped.Load(); d > 0 {
		logf("  %d commands not offered: the creators were behind", d)
	}
	var all int64
	_ = harness.Poll(ctx, c.drain, 200*time.Millisecond, func() bool {
		_ = f.DB.Pool.QueryRow(ctx, `SELECT count(*) /*bench*/ FROM commands WHERE state NOT IN ('succeeded', 'failed', 'cancelled', 'expired')`).Scan(&all)
		return all == 0
	})
	p.Unfinished = all
	rows, err := f.DB.Pool.Query(ctx, `SELECT extract(epoch FROM finished_at - created_at) /*bench*/ FROM commands
 WHERE state = 'succeeded' AND created_at >= $1 AND created_at < $2`, fromDB, toDB)
	if err != nil {
		return p, err
	}
	var ds []time.Duration
	for rows.Next() {
		var s float64
		if err := rows.Scan(&s); err != nil {
			rows.Close()
			return p, err
		}
		ds = append(ds, time.Duration(s*float64(time.Second)))
	}
	rows.Close()
	d := harness.Summarize(ds)
	p.Latency = &d
	return p, rows.Err()
}

// waitLoad waits up to c.loadWait for the 1-minute load average to fall to
// c.maxLoad: the machine may be shared, and a window measured beside
// someone else's CPU hogs measures them too.
func waitLoad(ctx context.Context, c config) error {
	load1 := func() float64 {
		var l float64
		_, _ = fmt.Sscan(harness.LoadAvg(), &l)
		return l
	}
	if c.maxLoad <= 0 || load1() <= c.maxLoad {
		return nil
	}
	logf("  load %s above %g: waiting up to %s", harness.LoadAvg(), c.maxLoad, c.loadWait)
	if err := harness.Poll(ctx, c.loadWait, 5*time.Second, func() bool { return load1() <= c.maxLoad }); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		logf("  load still %s: measuring anyway", harness.LoadAvg())
	}
	return nil
}

func (p phase) summary() string {
	s := fmt.Sprintf("PostgreSQL CPU %.3f s/s, %.1f statements/s, %.1f commits/s, %.0f WAL bytes/s, %.1f row writes/s, connections mean %.1f max %d (active %.1f); %d connected (%d in node_sessions), %d Hellos in the window",
		p.PGCPU, p.Statements, p.Commits, p.WALBytes, p.RowWrites, p.ConnsMean, p.ConnsMax, p.ActiveMean, p.Connected, p.DBConnected, p.Hellos)
	if p.Latency != nil {
		s += fmt.Sprintf("; offered %.1f/s, created %.1f/s, completed %.1f/s, create-to-done %s, %d unfinished, %d create errors",
			p.Offered, p.CreatedPS, p.CompletedPS, p.Latency, p.Unfinished, p.CreateErrors)
	}
	for _, st := range p.Costliest {
		s += fmt.Sprintf("\n      %8.1f ms %7d calls  %s", st.ExecMs, st.Calls, st.Query)
	}
	return s + fmt.Sprintf(" (load %s, at start %s)", p.Load, p.LoadStart)
}

// linear fits y = a + b*x by least squares (b = 0 with one point).
func linear(xs, ys []float64) (a, b float64) {
	n := float64(len(xs))
	if n == 0 {
		return 0, 0
	}
	var sx, sy, sxx, sxy float64
	for i := range xs {
		sx, sy, sxx, sxy = sx+xs[i], sy+ys[i], sxx+xs[i]*xs[i], sxy+xs[i]*ys[i]
	}
	if d := n*sxx - sx*sx; d != 0 {
		b = (n*sxy - sx*sy) / d
	}
	return (sy - b*sx) / n, b
}

// fitSteps fits each figure of the phase pick returns over the steps'
// node counts (in thousands) and extrapolates the capacity.
func fitSteps(c config, steps []step, pick func(step) *phase) *fit {
	var xs []float64
	var cpu, st, cm, wal []float64
	for _, s := range steps {
		p := pick(s)
		if p == nil {
			continue
		}
		xs = append(xs, float64(s.Nodes)/1000)
		cpu, st, cm, wal = append(cpu, p.PGCPU), append(st, p.Statements), append(cm, p.Commits), append(wal, p.WALBytes)
	}
	if len(xs) < 2 {
		return nil
	}
	ft := &fit{}
	ft.Fixed, ft.PerThousand = linear(xs, cpu)
	_, ft.StatementsPerThousand = linear(xs, st)
	_, ft.CommitsPerThousand = linear(xs, cm)
	_, ft.WALPerThousand = linear(xs, wal)
	if ft.PerThousand <= 0 {
		return ft // no growth measured: nothing to extrapolate
	}
	for _, k := range c.cores {
		ft.Capacity = append(ft.Capacity, capacity{Cores: k, Nodes: max(0, (c.headroom*float64(k)-ft.Fixed)/ft.PerThousand*1000)})
	}
	return ft
}

func (r *result) print(w io.Writer) {
	fmt.Fprintf(w, "\nscale: %d gateways behind HAProxy, worker, scheduler; commands %g per node per minute via %s; %.0f s warmup, %.0f s windows; %s; machine %s; %s\n",
		r.Gateways, r.PerNodePerMinute, r.Producer, r.Warmup, r.Window, r.Database, r.Machine, r.Date)
	fmt.Fprintf(w, "command: %s\n\n", r.Command)
	fmt.Fprintln(w, "| nodes | phase | PG CPU s/s | statements/s | commits/s | WAL bytes/s | row writes/s | connections mean / max (active) | Hellos in window | offered / completed cmd/s | create-to-done p50 / p99 | load (start → end) |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|---|---|")
	row := func(n int, name string, p *phase) {
		cmds, lat := "-", "-"
		if p.Latency != nil {
			cmds = fmt.Sprintf("%.1f / %.1f", p.Offered, p.CompletedPS)
			lat = fmt.Sprintf("%.3f / %.3f s", p.Latency.P50, p.Latency.P99)
		}
		fmt.Fprintf(w, "| %d | %s | %.3f | %.1f | %.1f | %.0f | %.1f | %.1f / %d (%.1f) | %d | %s | %s | %s → %s |\n", n, name, p.PGCPU, p.Statements, p.Commits,
			p.WALBytes, p.RowWrites, p.ConnsMean, p.ConnsMax, p.ActiveMean, p.Hellos, cmds, lat, p.LoadStart, p.Load)
	}
	for _, s := range r.Steps {
		row(s.Nodes, "idle", &s.Idle)
		if s.Commands != nil {
			row(s.Nodes, "commands", s.Commands)
		}
	}
	for _, f := range []struct {
		name string
		ft   *fit
	}{{"idle", r.Idle}, {fmt.Sprintf("%g command per node per minute", r.PerNodePerMinute), r.Commands}} {
		if f.ft == nil {
			continue
		}
		fmt.Fprintf(w, "\nfit, %s: PostgreSQL CPU = %.4f s/s + %.4f s/s per 1,000 nodes; per 1,000 nodes also %.1f statements/s, %.1f commits/s, %.0f WAL bytes/s\n",
			f.name, f.ft.Fixed, f.ft.PerThousand, f.ft.StatementsPerThousand, f.ft.CommitsPerThousand, f.ft.WALPerThousand)
		if len(f.ft.Capacity) == 0 {
			fmt.Fprintln(w, "no growth with the nodes measured: no capacity to extrapolate")
			continue
		}
		fmt.Fprintf(w, "nodes one primary holds with PostgreSQL at %.0f%% of its cores (linear extrapolation):", r.Headroom*100)
		for _, cp := range f.ft.Capacity {
			fmt.Fprintf(w, " %d cores %.0f;", cp.Cores, cp.Nodes)
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, "\n%s\n", r.Note)
}
