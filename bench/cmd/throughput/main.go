// Command throughput measures commands/s end to end (created, dispatched by
// a gateway, executed by a simulated node, result stored) through 1 and 3
// gateways behind HAProxy, and River's job throughput (inserted, worked by
// a separate riverclient process, completed) on the same PostgreSQL server,
// and prints the ratio.
//
// Offered load: by default (-rate 0) the creators are not paced: each of the
// -concurrency creators inserts again as soon as its last insert returns, on
// both sides. Where a side completes less than is created, its backlog grows
// during the window, its latency percentiles measure that backlog's age, and
// its per-command costs (divided by the commands completed in the window)
// include the surplus inserts. A fair comparison runs both sides at a rate
// each sustains: -rate caps the creators' total inserts per second (shared
// token pacing, the same for leasehold and River), so a sweep of -rate finds
// the highest rate at which each side keeps p99 create-to-done under 0.5 s.
//
// The simulated nodes run in a nodesim process of their own (cmd/nodesim),
// as River's jobs are worked by a riverclient process of its own: neither
// side's workers share the bench process's scheduler with the creators.
package main

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/leasehold/leasehold/bench/internal/fleet"
	"github.com/leasehold/leasehold/bench/internal/harness"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

type config struct {
	nodes, concurrency, backlog int
	rate                        float64
	riverWorkers, gateways      []int
	backlogDrain                time.Duration
	warmup, window, drain       time.Duration
	producer, jsonPath, binDir  string
	durable, river, ceiling     bool
	nodesProcess                bool
	keep, perSecond             bool
	gatewayArgs, apiArgs        []string
	// the overload scenario (overload.go)
	overload                bool
	overloadFactor          float64
	overloadFor, recoverFor time.Duration
	gatewayCPUs             float64
}

type measurement struct {
	System       string       `json:"system"`
	Gateways     int          `json:"gateways,omitempty"`
	RiverWorkers int          `json:"river_max_workers,omitempty"`
	Created      int64        `json:"created"`
	CreatedPS    float64      `json:"created_per_sec"`
	Completed    int64        `json:"completed_in_window"`
	CompletedPS  float64      `json:"completed_per_sec"`
	Latency      harness.Dist `json:"latency_create_to_done"`
	// InWindow is create-to-done of the commands (jobs) created in the
	// measuring window, the steady state the rates describe; Latency also
	// holds the warmup's, a fresh database's first seconds included.
	InWindow harness.Dist `json:"latency_create_to_done_in_window"`
	// The measuring window, on this machine's clock (the database's too).
	windowStart, windowEnd time.Time
	// leasehold's create-to-done in its two parts: waiting to be
	// dispatched, then the rest (the node's round trip and the gateway's
	// group commit, which stamps the result received and the command
	// finished at once).
	ToDispatch *harness.Dist `json:"latency_create_to_dispatch,omitempty"`
	AfterIt    *harness.Dist `json:"latency_dispatch_to_done,omitempty"`
	Unfinished int64         `json:"unfinished_after_drain"`
	// Per command completed in the window: PostgreSQL CPU (all its
	// processes), statements (pg_stat_statements) and transactions.
	PGCPUms    float64 `json:"pg_cpu_ms_per_command"`
	Statements float64 `json:"statements_per_command"`
	Commits    float64 `json:"commits_per_command"`
	// Rows inserted, updated and deleted in the database and WAL bytes
	// written by the server, per command completed in the window.
	RowWrites float64 `json:"row_writes_per_command"`
	WALBytes  float64 `json:"wal_bytes_per_command"`
	// IndexedWrites are the row versions per command that wrote index
	// entries (inserts and updates that were not HOT); HOTShare is the
	// share of updates that were HOT (pg_stat_user_tables, every table).
	IndexedWrites float64 `json:"indexed_row_writes_per_command"`
	HOTShare      float64 `json:"hot_update_share"`
	// ProcessCPUms is the CPU each role's processes used per command
	// completed in the window ("bench" is the creators' process, "pg"
	// PostgreSQL); TotalCPUms sums them: what a command costs the machine.
	ProcessCPUms map[string]float64 `json:"process_cpu_ms_per_command,omitempty"`
	TotalCPUms   float64            `json:"total_cpu_ms_per_command,omitempty"`
	// leasehold, from the gateways' histograms over the window.
	DispatchCallP50 float64 `json:"dispatch_call_p50_s,omitempty"`
	DispatchCallP99 float64 `json:"dispatch_call_p99_s,omitempty"`
	RenewP50        float64 `json:"lease_renew_p50_s,omitempty"`
	RenewP99        float64 `json:"lease_renew_p99_s,omitempty"`
	Load            string  `json:"load_average"`
	// The statements that took the most server time in the window, per
	// command completed in it.
	Costliest []statementShare `json:"costliest_statements,omitempty"`
}

// statementShare is one statement's calls and server time per command.
type statementShare struct {
	Query         string  `json:"query"`
	CallsPerCmd   float64 `json:"calls_per_command"`
	ExecUsPerCmd  float64 `json:"exec_us_per_command"`
	ExecUsPerCall float64 `json:"exec_us_per_call"`
}

// costliest reads the statements that took the most server time since the
// window's start, per command completed in it.
func (m *measurement) costliest(ctx context.Context, db *harness.Database) {
	top, err := db.CostliestStatements(ctx, 8)
	if err != nil || m.Completed <= 0 {
		return
	}
	n := float64(m.Completed)
	for _, st := range top {
		sh := statementShare{Query: st.Query, CallsPerCmd: float64(st.Calls) / n, ExecUsPerCmd: st.ExecMs * 1000 / n}
		if st.Calls > 0 {
			sh.ExecUsPerCall = st.ExecMs * 1000 / float64(st.Calls)
		}
		m.Costliest = append(m.Costliest, sh)
		logf("    %6.2f calls/cmd %7.1f us/cmd %7.1f us/call  %s", sh.CallsPerCmd, sh.ExecUsPerCmd, sh.ExecUsPerCall, sh.Query)
	}
}

// backlogResult is the backlog scenario: N pending commands inserted at
// once, then drained by one gateway.
type backlogResult struct {
	Pending         int     `json:"pending"`
	Rounds          int     `json:"rounds"`
	DrainSeconds    float64 `json:"drain_s"`
	DrainedPS       float64 `json:"drained_per_sec"`
	Unfinished      int64   `json:"unfinished"`
	DispatchCalls   float64 `json:"dispatch_calls"`
	DispatchCallP50 float64 `json:"dispatch_call_p50_s"`
	DispatchCallP99 float64 `json:"dispatch_call_p99_s"`
	Renewals        float64 `json:"lease_renewals"`
	RenewP50        float64 `json:"lease_renew_p50_s"`
	RenewP99        float64 `json:"lease_renew_p99_s"`
	// The same histograms over the steady run before it (few pending).
	SteadyDispatchCallP50 float64 `json:"steady_dispatch_call_p50_s"`
	SteadyDispatchCallP99 float64 `json:"steady_dispatch_call_p99_s"`
	Load                  string  `json:"load_average"`
	// Small is the same drain of one pending command per node, repeated
	// (before the large one, on the same fleet).
	Small *backlogResult `json:"small,omitempty"`
}

// smallBacklogRounds is how many times the small backlog is inserted and
// drained, so its dispatch-call quantiles rest on enough calls.
const smallBacklogRounds = 30

type result struct {
	Machine     string         `json:"machine"`
	Database    string         `json:"database"`
	Date        string         `json:"date"`
	Nodes       int            `json:"nodes"`
	Concurrency int            `json:"concurrency"`
	Rate        float64        `json:"offered_rate_per_sec,omitempty"`
	GatewayArgs []string       `json:"gateway_args,omitempty"`
	APIArgs     []string       `json:"api_args,omitempty"`
	GatewayCPUs float64        `json:"gateway_cpus,omitempty"`
	Producer    string         `json:"producer"`
	NodesProc   bool           `json:"nodes_in_own_process"`
	Window      float64        `json:"window_s"`
	Results     []measurement  `json:"results"`
	Backlog     *backlogResult `json:"backlog,omitempty"`
	// Ceiling is the creators alone (-ceiling): completed counts inserts.
	Ceiling   *measurement `json:"insert_ceiling,omitempty"`
	RiverBest float64      `json:"river_best_completed_per_sec"`
	Ratio     float64      `json:"ratio_leasehold_3gw_over_river_best"`
	Ratio1    float64      `json:"ratio_leasehold_1gw_over_river_best"`
	// Overload is the -overload scenario after the first leasehold run.
	Overload *overloadResult `json:"overload,omitempty"`
}

// logf is harness.Logf.
var logf = harness.Logf

func main() {
	var c config
	var gws, rws string
	flag.IntVar(&c.nodes, "nodes", 300, "simulated nodes")
	flag.StringVar(&gws, "gateways", "1,3", "gateway counts to measure")
	flag.IntVar(&c.concurrency, "concurrency", 16, "concurrent creators (each creates one command or job at a time)")
	flag.Float64Var(&c.rate, "rate", 0, "cap the creators' total creates per second (0: unpaced, each creator inserts again as soon as its last insert returns)")
	flag.StringVar(&rws, "river-workers", "100,500,1000", "River: MaxWorkers of the working client, one run each; the ratio uses the best")
	flag.IntVar(&c.backlog, "backlog", 100000, "backlog scenario after the first leasehold run: insert this many pending commands at once and drain them (0: off)")
	flag.DurationVar(&c.backlogDrain, "backlog-drain", 5*time.Minute, "backlog scenario: wait this long at most for the drain")
	flag.DurationVar(&c.warmup, "warmup", 5*time.Second, "load before the measuring window")
	flag.DurationVar(&c.window, "window", 20*time.Second, "measuring window")
	flag.DurationVar(&c.drain, "drain", 60*time.Second, "after the window, wait this long at most for the backlog")
	flag.StringVar(&c.producer, "producer", "sql", "leasehold commands: sql (one INSERT each, like River's Insert) or api (ControlService.CreateCommand)")
	flag.StringVar(&c.jsonPath, "json", "", "write the result as JSON to this file")
	flag.StringVar(&c.binDir, "bin", "", "use prebuilt leasehold-<service> binaries from this directory (default: build)")
	flag.BoolVar(&c.durable, "durable", true, "local PostgreSQL with fsync and synchronous_commit on")
	flag.BoolVar(&c.river, "river", true, "measure River too")
	flag.BoolVar(&c.ceiling, "ceiling", true, "first measure the creators alone: unpaced single-row inserts into commands, nothing dispatching them (what this machine can insert at all)")
	flag.BoolVar(&c.perSecond, "per-second", false, "after each leasehold run, log per second of dispatches the dispatch-to-done p99 and maximum and the slowest acknowledgement: where a tail came from")
	flag.BoolVar(&c.keep, "keep", false, "keep each run's work directory with every process's log")
	flag.BoolVar(&c.nodesProcess, "nodes-process", true, "run the simulated nodes in a nodesim process of their own, as River's worker has its own (false: in the bench process beside the creators)")
	flag.BoolVar(&c.overload, "overload", false, "after the first leasehold run (its completed/s is the maximum), offer -overload-factor times that for -overload-for, then half of it for -recover-for: completions against the maximum, the api's refusals (with -producer api), the seconds a gateway reported overload, recovery of p99")
	flag.Float64Var(&c.overloadFactor, "overload-factor", 2, "overload scenario: offered rate as a multiple of the maximum")
	flag.DurationVar(&c.overloadFor, "overload-for", 30*time.Second, "overload scenario: how long the overload lasts")
	flag.DurationVar(&c.recoverFor, "recover-for", 40*time.Second, "overload scenario: how long half the maximum is offered after it")
	flag.Float64Var(&c.gatewayCPUs, "gateway-cpus", 0, "cap each gateway at this many cores (a cgroup's CPU quota; 0: no cap), so the gateways, not the creators, are what saturates on a small machine")
	flag.Func("api-arg", "an extra api flag, e.g. --api.overload-admission=false (repeatable)", func(v string) error {
		c.apiArgs = append(c.apiArgs, v)
		return nil
	})
	flag.Func("gateway-arg", "an extra gateway flag, e.g. --gateway.dispatch-batch=100 (repeatable)", func(v string) error {
		c.gatewayArgs = append(c.gatewayArgs, v)
		return nil
	})
	flag.Parse()
	if c.overload {
		if c.overloadFor <= overloadWarmup {
			fmt.Fprintf(os.Stderr, "throughput: -overload-for %s must be longer than %s\n", c.overloadFor, overloadWarmup)
			os.Exit(2)
		}
	}
	for _, l := range []struct {
		flag, val string
		out       *[]int
	}{{"-gateways", gws, &c.gateways}, {"-river-workers", rws, &c.riverWorkers}} {
		for _, g := range strings.Split(l.val, ",") {
			var n int
			if _, err := fmt.Sscan(strings.TrimSpace(g), &n); err != nil || n < 1 {
				fmt.Fprintf(os.Stderr, "throughput: bad %s %q\n", l.flag, l.val)
				os.Exit(2)
			}
			*l.out = append(*l.out, n)
		}
	}
	sup := &harness.Supervisor{}
	var mu sync.Mutex
	var fleets []*fleet.Fleet
	ctx, cancel := harness.SignalContext(func() {
		sup.Stop()
		mu.Lock()
		for _, f := range fleets {
			f.Sup.Stop()
		}
		mu.Unlock()
	})
	defer cancel()
	res, err := run(ctx, c, sup, func(f *fleet.Fleet) { mu.Lock(); fleets = append(fleets, f); mu.Unlock() })
	if err != nil {
		fmt.Fprintln(os.Stderr, "throughput:", err)
		os.Exit(2)
	}
	res.print(os.Stdout)
	if err := harness.WriteJSON(c.jsonPath, res); err != nil {
		fmt.Fprintln(os.Stderr, "throughput: write json:", err)
		os.Exit(2) // -json was asked for and not written
	}
}

func run(ctx context.Context, c config, sup *harness.Supervisor, started func(*fleet.Fleet)) (*result, error) {
	logf("starting PostgreSQL")
	srv, err := harness.StartServer(ctx, c.durable)
	if err != nil {
		return nil, err
	}
	defer srv.Stop()
	defer sup.Stop()
	r := &result{Machine: harness.Host(), Database: srv.Desc, Date: time.Now().UTC().Format(time.RFC3339), Nodes: c.nodes,
		Concurrency: c.concurrency, Rate: c.rate, GatewayArgs: c.gatewayArgs, APIArgs: c.apiArgs, GatewayCPUs: c.gatewayCPUs, NodesProc: c.nodesProcess, Producer: c.producer, Window: c.window.Seconds()}
	if c.ceiling {
		m, err := insertCeiling(ctx, c, srv)
		if err != nil {
			return nil, err
		}
		r.Ceiling = &m
	}
	binDir := c.binDir
	for i, g := range c.gateways {
		backlog := 0
		if i == 0 {
			backlog = c.backlog
		}
		var ov **overloadResult
		if i == 0 && c.overload {
			ov = &r.Overload
		}
		m, bl, dir, err := leasehold(ctx, c, srv, sup, g, backlog, binDir, started, ov)
		if err != nil {
			return nil, err
		}
		if binDir == "" {
			binDir = dir // build once
		}
		r.Results = append(r.Results, m)
		if bl != nil {
			r.Backlog = bl
		}
	}
	if binDir != c.binDir {
		defer os.RemoveAll(binDir)
	}
	if c.river {
		for _, w := range c.riverWorkers {
			m, err := riverRun(ctx, c, srv, sup, w)
			if err != nil {
				return nil, err
			}
			r.Results = append(r.Results, m)
			r.RiverBest = max(r.RiverBest, m.CompletedPS)
		}
		for _, lm := range r.Results {
			if lm.System == "leasehold" && r.RiverBest > 0 {
				if lm.Gateways == 3 {
					r.Ratio = lm.CompletedPS / r.RiverBest
				}
				if lm.Gateways == 1 {
					r.Ratio1 = lm.CompletedPS / r.RiverBest
				}
			}
		}
	}
	return r, nil
}

// cost is a cumulative sample of what PostgreSQL spent.
type cost struct {
	cpu                        float64
	procs                      map[string]float64
	stmts, xacts, rows, walLen int64
	writes                     harness.TableWrites
}

// sampleCost samples PostgreSQL's counters and the CPU of sups' processes
// and of this one.
func sampleCost(ctx context.Context, srv *harness.Server, db *harness.Database, sups ...*harness.Supervisor) cost {
	var c cost
	c.cpu, _ = srv.CPU()
	c.procs = harness.CPUByRole(sups...)
	c.stmts, _ = db.Statements(ctx)
	c.xacts, _ = db.Xacts(ctx)
	c.rows, _ = db.RowWrites(ctx)
	c.walLen, _ = db.WALBytes(ctx)
	c.writes, _ = db.Writes(ctx)
	return c
}

// perCommand fills m's costs per command completed in the window.
func (m *measurement) perCommand(c0, c1 cost) {
	if m.Completed <= 0 {
		return
	}
	n := float64(m.Completed)
	m.PGCPUms = (c1.cpu - c0.cpu) * 1000 / n
	m.Statements = float64(c1.stmts-c0.stmts) / n
	m.Commits = float64(c1.xacts-c0.xacts) / n
	m.RowWrites = float64(c1.rows-c0.rows) / n
	m.WALBytes = float64(c1.walLen-c0.walLen) / n
	ins, upd, hot := c1.writes.Inserts-c0.writes.Inserts, c1.writes.Updates-c0.writes.Updates, c1.writes.HOTUpdates-c0.writes.HOTUpdates
	m.IndexedWrites = float64(ins+upd-hot) / n
	if upd > 0 {
		m.HOTShare = float64(hot) / float64(upd)
	}
	m.ProcessCPUms = map[string]float64{"pg": m.PGCPUms}
	m.TotalCPUms = m.PGCPUms
	for role, end := range c1.procs {
		if start, ok := c0.procs[role]; ok {
			ms := (end - start) * 1000 / n
			m.ProcessCPUms[role] += ms
			m.TotalCPUms += ms
		}
	}
}

// logWindow logs create-to-done of what was created in the window and
// the CPU per command by role.
func (m *measurement) logWindow() {
	logf("  created in the window: latency %s", m.InWindow)
	logf("  %s", m.cpuLine())
}

// cpuLine is m's CPU per command by role, the costliest first.
func (m *measurement) cpuLine() string {
	roles := make([]string, 0, len(m.ProcessCPUms))
	for r := range m.ProcessCPUms {
		roles = append(roles, r)
	}
	slices.SortFunc(roles, func(a, b string) int { return cmp.Compare(m.ProcessCPUms[b], m.ProcessCPUms[a]) })
	parts := make([]string, 0, len(roles))
	for _, r := range roles {
		parts = append(parts, fmt.Sprintf("%s %.3f", r, m.ProcessCPUms[r]))
	}
	return fmt.Sprintf("CPU ms per command %.3f: %s", m.TotalCPUms, strings.Join(parts, ", "))
}

// measure runs the creators (create) against db and fills m's counts,
// rates, load and costs per command over the window; count reads how many
// are completed.
func (m *measurement) measure(ctx context.Context, c config, srv *harness.Server, db *harness.Database, sup *harness.Supervisor, create func(context.Context) error, count func() int64) error {
	var c0, c1 cost
	created, cps, done, err := measure(ctx, c, create, count, func(start bool) {
		if start {
			// No ANALYZE here: the tables grew from empty during the
			// warmup, faster than autovacuum's first pass, and keeping
			// the gateway's generic plans right through that is the
			// gateway's job (pgdb.RefreshPlanStats), measured as a fresh
			// install would see it.
			_ = db.ResetStatements(ctx)
			m.windowStart = time.Now()
			c0 = sampleCost(ctx, srv, db, sup)
		} else {
			m.windowEnd = time.Now()
			c1 = sampleCost(ctx, srv, db, sup)
		}
	})
	if err != nil {
		return err
	}
	m.Load = harness.LoadAvg()
	m.Created, m.CreatedPS, m.Completed, m.CompletedPS = created, cps, done, float64(done)/c.window.Seconds()
	m.perCommand(c0, c1)
	return nil
}

// gatewayHistograms sums histogram name over the fleet's gateways.
func gatewayHistograms(ctx context.Context, f *fleet.Fleet, name string) histogram {
	sum := histogram{}
	for _, g := range f.Gateways {
		h, err := scrapeHistogram(ctx, "http://"+g.HTTP+"/metrics", name)
		if err != nil {
			logf("  %v", err)
			continue
		}
		sum = sum.add(h)
	}
	return sum
}

const (
	dispatchCallMetric = "leasehold_gateway_dispatch_call_seconds"
	renewMetric        = "leasehold_gateway_lease_renew_seconds"
)

func leasehold(ctx context.Context, c config, srv *harness.Server, sup *harness.Supervisor, gateways, backlog int, binDir string, started func(*fleet.Fleet), overload **overloadResult) (measurement, *backlogResult, string, error) {
	m := measurement{System: "leasehold", Gateways: gateways}
	f, err := fleet.Start(ctx, fleet.Options{Gateways: gateways, Timings: fleet.Real, NoAPI: c.producer != "api",
		MaxConns: c.nodes + 100, BinDir: binDir, Server: srv, Durable: c.durable, Log: logf,
		GatewayArgs: c.gatewayArgs, APIArgs: c.apiArgs})
	started(f)
	keepBins := binDir == ""
	dir := ""
	if f.Dir != "" && keepBins {
		// Keep the built binaries for the next fleet.
		dir, _ = os.MkdirTemp("", "leasehold-throughput-bin-")
		for _, s := range []string{"gateway", "worker", "scheduler", "api"} {
			if p, ok := f.Bins[s]; ok {
				_ = os.Rename(p, filepath.Join(dir, filepath.Base(p)))
				f.Bins[s] = filepath.Join(dir, filepath.Base(p))
			}
		}
	}
	defer func() {
		f.Close(c.keep)
		if c.keep && f.Dir != "" {
			logf("logs kept in %s", f.Dir)
		}
	}()
	if err != nil {
		return m, nil, dir, err
	}
	if c.gatewayCPUs > 0 {
		for _, g := range f.Gateways {
			undo, err := harness.LimitCPU(g.Name, g.Proc.Cmd.Process.Pid, c.gatewayCPUs)
			if err != nil {
				return m, nil, dir, fmt.Errorf("-gateway-cpus: %w", err)
			}
			defer undo()
		}
		logf("each gateway capped at %.2f cores", c.gatewayCPUs)
	}
	ids, creds, err := harness.RegisterNodes(ctx, f.DB.Pool, "node", c.nodes)
	if err != nil {
		return m, nil, dir, err
	}
	connected, stopNodes, err := startNodes(ctx, c, sup, f.Address(), ids, creds, 200*gateways)
	if err != nil {
		return m, nil, dir, err
	}
	defer stopNodes()
	if err := poll(ctx, 2*time.Minute, func() bool { return connected() == c.nodes }); err != nil {
		return m, nil, dir, fmt.Errorf("nodes did not connect: %w", err)
	}
	prod := f.NewProducer(c.producer == "api")
	defer prod.Close()
	count := func() int64 {
		var n int64
		_ = f.DB.Pool.QueryRow(ctx, `SELECT count(*) /*bench*/ FROM commands WHERE state = 'succeeded'`).Scan(&n)
		return n
	}
	logf("leasehold, %d gateway(s): %d creators for %s + %s", gateways, c.concurrency, c.warmup, c.window)
	var (
		c0, c1   cost
		dc0, dc1 histogram
		rn0, rn1 histogram
	)
	created, cps, done, err := measure(ctx, c, func(ctx context.Context) error {
		return prod.Create(ctx, ids[rand.IntN(len(ids))])
	}, count, func(start bool) {
		if start {
			_ = f.DB.ResetStatements(ctx)
			m.windowStart = time.Now()
		} else {
			m.windowEnd = time.Now()
		}
		cs := sampleCost(ctx, srv, f.DB, f.Sup, sup)
		dc := gatewayHistograms(ctx, f, dispatchCallMetric)
		rn := gatewayHistograms(ctx, f, renewMetric)
		if start {
			c0, dc0, rn0 = cs, dc, rn
		} else {
			c1, dc1, rn1 = cs, dc, rn
		}
	})
	if err != nil {
		return m, nil, dir, err
	}
	m.Load = harness.LoadAvg()
	m.Created, m.CreatedPS, m.Completed, m.CompletedPS = created, cps, done, float64(done)/c.window.Seconds()
	m.perCommand(c0, c1)
	m.costliest(ctx, f.DB)
	dc, rn := dc1.sub(dc0), rn1.sub(rn0)
	m.DispatchCallP50, m.DispatchCallP99 = dc.quantile(0.5), dc.quantile(0.99)
	m.RenewP50, m.RenewP99 = rn.quantile(0.5), rn.quantile(0.99)
	_ = poll(ctx, c.drain, func() bool { return count() == created })
	_ = f.DB.Pool.QueryRow(ctx, `SELECT count(*) /*bench*/ FROM commands WHERE state <> 'succeeded'`).Scan(&m.Unfinished)
	m.Latency, err = latencies(ctx, f.DB, `SELECT extract(epoch FROM finished_at - created_at) /*bench*/ FROM commands WHERE state = 'succeeded'`)
	// The same over the commands created in the window, whole and split
	// at the dispatch.
	inWindow := func(span string) (harness.Dist, error) {
		return latencies(ctx, f.DB, `SELECT extract(epoch FROM `+span+`) /*bench*/ FROM commands WHERE state = 'succeeded'
   AND created_at >= $1 AND created_at < $2`, m.windowStart, m.windowEnd)
	}
	if err == nil {
		m.InWindow, err = inWindow("finished_at - created_at")
	}
	for _, part := range []struct {
		dist **harness.Dist
		span string
	}{
		{&m.ToDispatch, "dispatched_at - created_at"},
		{&m.AfterIt, "finished_at - dispatched_at"},
	} {
		if d, err := inWindow(part.span); err == nil {
			*part.dist = &d
		}
	}
	if c.perSecond {
		perSecond(ctx, f.DB)
	}
	if m.ToDispatch != nil && m.AfterIt != nil {
		logf("  create to dispatch %s; dispatch to done %s", *m.ToDispatch, *m.AfterIt)
	}
	logf("  %.0f created/s, %.0f completed/s, latency %s; per command: PostgreSQL CPU %.2f ms, %.2f statements, %.2f commits, %.2f row writes, %.0f WAL bytes; dispatch call p50 %.1f ms p99 %.1f ms (load %s)",
		m.CreatedPS, m.CompletedPS, m.Latency, m.PGCPUms, m.Statements, m.Commits, m.RowWrites, m.WALBytes, m.DispatchCallP50*1000, m.DispatchCallP99*1000, m.Load)
	m.logWindow()
	if err != nil {
		return m, nil, dir, err
	}
	if overload != nil {
		if *overload, err = overloadRun(ctx, c, f, prod, ids, count, m.CompletedPS, m.ProcessCPUms["gw"]*m.CompletedPS/1000); err != nil {
			return m, nil, dir, err
		}
	}
	if backlog <= 0 {
		return m, nil, dir, nil
	}
	// The same drain with one pending command per node, many times over:
	// the baseline the "within 2x of 300 pending" compares with.
	small, err := backlogRun(ctx, c, f, c.nodes, smallBacklogRounds, count)
	if err != nil {
		return m, nil, dir, err
	}
	bl, err := backlogRun(ctx, c, f, backlog, 1, count)
	if bl != nil {
		bl.SteadyDispatchCallP50, bl.SteadyDispatchCallP99 = m.DispatchCallP50, m.DispatchCallP99
		bl.Small = small
	}
	return m, bl, dir, err
}

// startNodes runs the simulated nodes: in a nodesim process of their own
// (the default, as River's worker has its own), or in this process beside
// the creators (-nodes-process=false, how the bench ran before). connected
// counts the nodes with an open session.
func startNodes(ctx context.Context, c config, sup *harness.Supervisor, address string, ids, creds []string, rate int) (connected func() int, stop func(), err error) {
	if !c.nodesProcess {
		sim := &fleet.Sim{}
		for i := range ids {
			if _, err := sim.Add(address, ids[i], creds[i], nodev1.NodeKind_NODE_KIND_NODE); err != nil {
				return nil, nil, err
			}
		}
		simCtx, cancel := context.WithCancel(ctx)
		go sim.Start(simCtx, rate)
		return sim.Connected, func() { cancel(); sim.Wait() }, nil
	}
	dir, err := os.MkdirTemp("", "leasehold-throughput-nodes-")
	if err != nil {
		return nil, nil, err
	}
	bin, err := fleet.BuildNodesim(dir)
	if err != nil {
		os.RemoveAll(dir)
		return nil, nil, err
	}
	np, err := fleet.StartNodeProcess(sup, bin, "nodesim", dir, address, ids, creds, rate)
	if err != nil {
		os.RemoveAll(dir)
		return nil, nil, err
	}
	return np.Connected, func() {
		np.Stop()
		os.RemoveAll(dir)
	}, nil
}

// backlogRun inserts n pending commands at once (spread over the nodes),
// wakes the gateways and waits for the drain, rounds times over, reading
// the gateways' dispatch-call and lease-renewal histograms over all rounds.
func backlogRun(ctx context.Context, c config, f *fleet.Fleet, n, rounds int, count func() int64) (*backlogResult, error) {
	bl := &backlogResult{Pending: n, Rounds: rounds}
	before := count()
	dc0, rn0 := gatewayHistograms(ctx, f, dispatchCallMetric), gatewayHistograms(ctx, f, renewMetric)
	logf("backlog: inserting %d pending commands at once, %d time(s)", n, rounds)
	start := time.Now()
	for r := 1; r <= rounds; r++ {
		if _, err := f.DB.Pool.Exec(ctx, `
INSERT INTO commands (node_id, kind, payload)
SELECT 'node-' || (i % $1), 'bench.echo', 'x' FROM generate_series(1, $2) AS i`, c.nodes, n); err != nil {
			return nil, fmt.Errorf("backlog insert: %w", err)
		}
		if _, err := f.DB.Pool.Exec(ctx, `SELECT pg_notify('leasehold_commands', '')`); err != nil {
			return nil, err
		}
		_ = poll(ctx, c.backlogDrain, func() bool { return count() >= before+int64(r*n) })
	}
	bl.DrainSeconds = time.Since(start).Seconds()
	bl.Load = harness.LoadAvg()
	bl.Unfinished = before + int64(rounds*n) - count()
	bl.DrainedPS = float64(int64(rounds*n)-bl.Unfinished) / bl.DrainSeconds
	dc := gatewayHistograms(ctx, f, dispatchCallMetric).sub(dc0)
	rn := gatewayHistograms(ctx, f, renewMetric).sub(rn0)
	bl.DispatchCalls, bl.DispatchCallP50, bl.DispatchCallP99 = dc.count(), dc.quantile(0.5), dc.quantile(0.99)
	bl.Renewals, bl.RenewP50, bl.RenewP99 = rn.count(), rn.quantile(0.5), rn.quantile(0.99)
	logf("  drained %d x %d in %.1f s (%.0f/s, %d unfinished); dispatch call p50 %.1f ms p99 %.1f ms over %.0f calls; lease renewal p50 %.1f ms p99 %.1f ms over %.0f (load %s)",
		rounds, n, bl.DrainSeconds, bl.DrainedPS, bl.Unfinished, bl.DispatchCallP50*1000, bl.DispatchCallP99*1000, bl.DispatchCalls,
		bl.RenewP50*1000, bl.RenewP99*1000, bl.Renewals, bl.Load)
	return bl, nil
}

func riverRun(ctx context.Context, c config, srv *harness.Server, sup *harness.Supervisor, workers int) (measurement, error) {
	m := measurement{System: "River", RiverWorkers: workers}
	db, err := srv.CreateDatabase(ctx, "river")
	if err != nil {
		return m, err
	}
	defer db.Drop()
	migrator, err := rivermigrate.New(riverpgxv5.New(db.Pool), &rivermigrate.Config{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return m, err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return m, err
	}
	dir, err := os.MkdirTemp("", "leasehold-throughput-river-")
	if err != nil {
		return m, err
	}
	defer os.RemoveAll(dir)
	bin := filepath.Join(dir, "riverclient")
	if err := harness.GoBuild(filepath.Join(harness.RepoRoot(), "bench", "cmd", "riverclient"), bin); err != nil {
		return m, err
	}
	started := make(chan struct{})
	var once sync.Once
	p, err := sup.StartLines("riverclient-worker", bin, nil, func(l string) {
		if l == "STARTED" {
			once.Do(func() { close(started) })
		}
	}, "-database-url", db.URL, "-id", "river-worker", "-mode", "work", "-workers", fmt.Sprint(workers))
	if err != nil {
		return m, err
	}
	defer func() { _ = p.Signal(syscall.SIGTERM); p.Wait(30 * time.Second) }()
	select {
	case <-started:
	case <-time.After(30 * time.Second):
		return m, fmt.Errorf("riverclient did not start: %s", p.Tail())
	}
	// An insert-only client in this process, like the leasehold producer.
	client, err := river.NewClient(riverpgxv5.New(db.Pool), &river.Config{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return m, err
	}
	count := func() int64 {
		var n int64
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) /*bench*/ FROM river_job WHERE state = 'completed'`).Scan(&n)
		return n
	}
	logf("River: %d inserters for %s + %s, worker process with MaxWorkers %d", c.concurrency, c.warmup, c.window, workers)
	var seq atomic.Int64
	if err := m.measure(ctx, c, srv, db, sup, func(ctx context.Context) error {
		_, err := client.Insert(ctx, noopArgs{N: int(seq.Add(1))}, nil)
		return err
	}, count); err != nil {
		return m, err
	}
	m.costliest(ctx, db)
	_ = poll(ctx, c.drain, func() bool { return count() == m.Created })
	_ = db.Pool.QueryRow(ctx, `SELECT count(*) /*bench*/ FROM river_job WHERE state <> 'completed'`).Scan(&m.Unfinished)
	m.Latency, err = latencies(ctx, db, `SELECT extract(epoch FROM finalized_at - created_at) /*bench*/ FROM river_job WHERE state = 'completed'`)
	if err == nil {
		m.InWindow, err = latencies(ctx, db, `SELECT extract(epoch FROM finalized_at - created_at) /*bench*/ FROM river_job WHERE state = 'completed'
   AND created_at >= $1 AND created_at < $2`, m.windowStart, m.windowEnd)
	}
	logf("  %.0f inserted/s, %.0f completed/s, latency %s; per job: PostgreSQL CPU %.2f ms, %.2f statements, %.2f commits, %.2f row writes, %.0f WAL bytes (load %s)",
		m.CreatedPS, m.CompletedPS, m.Latency, m.PGCPUms, m.Statements, m.Commits, m.RowWrites, m.WALBytes, m.Load)
	m.logWindow()
	return m, err
}

// insertCeiling measures the creators alone, unpaced, on a database of
// their own: the same single-row INSERT as the sql producer, nothing
// dispatching or working the rows. Neither system can complete more per
// second than this machine can insert, which bounds any ratio.
func insertCeiling(ctx context.Context, c config, srv *harness.Server) (measurement, error) {
	m := measurement{System: "inserts alone"}
	db, err := srv.CreateDatabase(ctx, "ceiling")
	if err != nil {
		return m, err
	}
	defer db.Drop()
	ids, _, err := harness.RegisterNodes(ctx, db.Pool, "node", c.nodes)
	if err != nil {
		return m, err
	}
	count := func() int64 {
		var n int64
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) /*bench*/ FROM commands`).Scan(&n)
		return n
	}
	unpaced := c
	unpaced.rate = 0
	logf("inserts alone: %d creators, unpaced, for %s + %s", c.concurrency, c.warmup, c.window)
	if err := m.measure(ctx, unpaced, srv, db, nil, func(ctx context.Context) error {
		_, err := db.Pool.Exec(ctx, `INSERT INTO commands (node_id, kind, payload) VALUES ($1, 'bench.echo', 'x')`, ids[rand.IntN(len(ids))])
		return err
	}, count); err != nil {
		return m, err
	}
	logf("  %.0f inserted/s; per insert: PostgreSQL CPU %.2f ms, %.2f statements, %.2f commits, %.2f row writes, %.0f WAL bytes (load %s)",
		m.CompletedPS, m.PGCPUms, m.Statements, m.Commits, m.RowWrites, m.WALBytes, m.Load)
	return m, nil
}

// perSecond logs, for each second of dispatches, the commands dispatched
// and the p99 and maximum of dispatch to done, and the slowest
// acknowledgement and the slowest acknowledgement to done: where a tail
// came from.
func perSecond(ctx context.Context, db *harness.Database) {
	rows, err := db.Pool.Query(ctx, `
SELECT date_trunc('second', dispatched_at), count(*),
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - dispatched_at)),
       max(extract(epoch FROM finished_at - dispatched_at)),
       coalesce(max(extract(epoch FROM acked_at - dispatched_at)), 0),
       coalesce(max(extract(epoch FROM finished_at - acked_at)), 0) /*bench*/
  FROM commands WHERE state = 'succeeded' GROUP BY 1 ORDER BY 1`)
	if err != nil {
		logf("  per second: %v", err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var (
			t                 time.Time
			n                 int64
			p99, mx, ack, fin float64
		)
		if err := rows.Scan(&t, &n, &p99, &mx, &ack, &fin); err != nil {
			logf("  per second: %v", err)
			return
		}
		logf("    %s dispatched %d, dispatch to done p99 %.3f s max %.3f s, slowest ack %.3f s, slowest ack to done %.3f s",
			t.Format("15:04:05"), n, p99, mx, ack, fin)
	}
}

// noopArgs matches riverclient's NoopArgs (kind bench_noop).
type noopArgs struct {
	N int `json:"n"`
}

func (noopArgs) Kind() string { return "bench_noop" }

// measure runs creators for warmup+window and returns what they created,
// the creation rate, and completions counted over the window.
func measure(ctx context.Context, c config, create func(context.Context) error, completed func() int64, sample func(start bool)) (int64, float64, int64, error) {
	cctx, stop := context.WithCancel(ctx)
	var n, errs atomic.Int64
	var firstErr atomic.Value
	start := time.Now()
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		runCreators(cctx, c.concurrency, pace(cctx, c.rate, c.concurrency), create, func(err error) {
			if err == nil {
				n.Add(1)
			} else if errs.Add(1) == 1 {
				firstErr.Store(err)
			}
		})
	}()
	_ = harness.Sleep(ctx, c.warmup)
	c0 := completed()
	sample(true)
	_ = harness.Sleep(ctx, c.window)
	c1 := completed()
	sample(false)
	stop()
	<-stopped
	el := time.Since(start).Seconds()
	if e := errs.Load(); e > 0 {
		logf("  %d create errors, first: %v", e, firstErr.Load())
	}
	return n.Load(), float64(n.Load()) / el, c1 - c0, ctx.Err()
}

// runCreators runs n creators until ctx ends, each creating one command
// (or job) at a time within 10 s, after taking a token when tokens is not
// nil (unpaced otherwise), and reporting each outcome to done. It returns
// once every creator has stopped.
func runCreators(ctx context.Context, n int, tokens <-chan struct{}, create func(context.Context) error, done func(error)) {
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			for ctx.Err() == nil {
				if tokens != nil {
					select {
					case <-tokens:
					case <-ctx.Done():
						return
					}
				}
				rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
				err := create(rctx)
				cancel()
				done(err)
			}
		})
	}
	wg.Wait()
}

func latencies(ctx context.Context, db *harness.Database, sql string, args ...any) (harness.Dist, error) {
	rows, err := db.Pool.Query(ctx, sql, args...)
	if err != nil {
		return harness.Dist{}, err
	}
	secs, err := pgx.CollectRows(rows, pgx.RowTo[float64])
	if err != nil {
		return harness.Dist{}, err
	}
	ds := make([]time.Duration, len(secs))
	for i, s := range secs {
		ds[i] = time.Duration(s * float64(time.Second))
	}
	return harness.Summarize(ds), nil
}

func poll(ctx context.Context, timeout time.Duration, cond func() bool) error {
	return harness.Poll(ctx, timeout, 200*time.Millisecond, cond)
}

func (r *result) print(w io.Writer) {
	fmt.Fprintf(w, "\nthroughput: %d nodes, %d concurrent creators (leasehold via %s), %.0f s window; %s; machine %s; %s\n\n",
		r.Nodes, r.Concurrency, r.Producer, r.Window, r.Database, r.Machine, r.Date)
	if r.GatewayCPUs > 0 || len(r.GatewayArgs)+len(r.APIArgs) > 0 {
		fmt.Fprintf(w, "gateways capped at %.2f cores (0: not capped); gateway flags %q; api flags %q\n\n", r.GatewayCPUs, r.GatewayArgs, r.APIArgs)
	}
	fmt.Fprintln(w, "| system | gateways / MaxWorkers | created/s | completed/s | latency p50 | latency p99 | p99 in window | CPU ms/cmd, all | PG CPU ms/cmd | statements/cmd | commits/cmd | row writes/cmd | indexed writes/cmd | HOT updates | WAL bytes/cmd | unfinished | load |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
	for _, m := range slices.Clone(r.Results) {
		g := fmt.Sprint(m.Gateways)
		if m.System == "River" {
			g = fmt.Sprintf("MaxWorkers %d", m.RiverWorkers)
		}
		fmt.Fprintf(w, "| %s | %s | %.0f | %.0f | %.3f s | %.3f s | %.3f s | %.3f | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f%% | %.0f | %d | %s |\n", m.System, g, m.CreatedPS, m.CompletedPS,
			m.Latency.P50, m.Latency.P99, m.InWindow.P99, m.TotalCPUms, m.PGCPUms, m.Statements, m.Commits, m.RowWrites, m.IndexedWrites, m.HOTShare*100, m.WALBytes, m.Unfinished, m.Load)
	}
	if r.Ceiling != nil {
		fmt.Fprintf(w, "\ninserts alone (the same creators unpaced, nothing completing them): %.0f/s, PostgreSQL CPU %.2f ms per insert (load %s)\n",
			r.Ceiling.CompletedPS, r.Ceiling.PGCPUms, r.Ceiling.Load)
	}
	if r.RiverBest > 0 {
		fmt.Fprintf(w, "\nratio leasehold/River at its best (%.0f completed/s):", r.RiverBest)
		if r.Ratio1 > 0 {
			fmt.Fprintf(w, " 1 gateway %.2f", r.Ratio1)
		}
		if r.Ratio > 0 {
			fmt.Fprintf(w, " 3 gateways %.2f", r.Ratio)
		}
		fmt.Fprintln(w)
	}
	if r.Overload != nil {
		r.Overload.print(w)
	}
	if b := r.Backlog; b != nil {
		fmt.Fprintf(w, "\nbacklog: %d pending drained in %.1f s (%.0f/s, %d unfinished), load %s\n", b.Pending, b.DrainSeconds, b.DrainedPS, b.Unfinished, b.Load)
		fmt.Fprintf(w, "dispatch call p50 / p99: %.1f / %.1f ms while draining (%.0f calls) vs %.1f / %.1f ms in the steady run\n",
			b.DispatchCallP50*1000, b.DispatchCallP99*1000, b.DispatchCalls, b.SteadyDispatchCallP50*1000, b.SteadyDispatchCallP99*1000)
		if sm := b.Small; sm != nil && sm.DispatchCallP50 > 0 {
			fmt.Fprintf(w, "vs %.1f / %.1f ms draining %d pending (%d rounds, %.0f calls): ratio p50 %.2f, p99 %.2f (target <= 2)\n",
				sm.DispatchCallP50*1000, sm.DispatchCallP99*1000, sm.Pending, sm.Rounds, sm.DispatchCalls,
				b.DispatchCallP50/sm.DispatchCallP50, b.DispatchCallP99/sm.DispatchCallP99)
		}
		fmt.Fprintf(w, "gateway lease renewal p50 / p99 while draining: %.1f / %.1f ms (%.0f renewals; a quantile at the largest bucket bound means beyond it)\n", b.RenewP50*1000, b.RenewP99*1000, b.Renewals)
	}
}

// pace returns nil when rate <= 0 (creators unpaced), or a channel that
// receives rate tokens per second until ctx ends. Tokens not taken are
// dropped beyond a buffer of burst, so creators that fall behind do not
// catch up in a burst: the offered rate never exceeds rate.
func pace(ctx context.Context, rate float64, burst int) <-chan struct{} {
	if rate <= 0 {
		return nil
	}
	ch := make(chan struct{}, max(burst, 1))
	go func() {
		t := time.NewTicker(5 * time.Millisecond)
		defer t.Stop()
		start := time.Now()
		var due int64
		for {
			select {
			case <-ctx.Done():
				return
			case now := <-t.C:
				target := int64(rate * now.Sub(start).Seconds())
				for ; due < target; due++ {
					select {
					case ch <- struct{}{}:
					default:
					}
				}
			}
		}
	}()
	return ch
}
