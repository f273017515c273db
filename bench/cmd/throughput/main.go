// Command throughput measures commands/s end to end (created, dispatched by
// a gateway, executed by a simulated node, result stored) through 1 and 3
// gateways behind HAProxy, and River's job throughput (inserted, worked by
// a separate riverclient process, completed) on the same PostgreSQL server,
// and prints the ratio.
package main

import (
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
	nodes, concurrency, riverWorkers int
	gateways                         []int
	warmup, window, drain            time.Duration
	producer, jsonPath, binDir       string
	durable, river                   bool
}

type measurement struct {
	System      string       `json:"system"`
	Gateways    int          `json:"gateways,omitempty"`
	Created     int64        `json:"created"`
	CreatedPS   float64      `json:"created_per_sec"`
	Completed   int64        `json:"completed_in_window"`
	CompletedPS float64      `json:"completed_per_sec"`
	Latency     harness.Dist `json:"latency_create_to_done"`
	Unfinished  int64        `json:"unfinished_after_drain"`
}

type result struct {
	Machine     string        `json:"machine"`
	Database    string        `json:"database"`
	Date        string        `json:"date"`
	Nodes       int           `json:"nodes"`
	Concurrency int           `json:"concurrency"`
	Producer    string        `json:"producer"`
	Window      float64       `json:"window_s"`
	Results     []measurement `json:"results"`
	Ratio       float64       `json:"ratio_leasehold_3gw_over_river"`
	Ratio1      float64       `json:"ratio_leasehold_1gw_over_river"`
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s  %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
}

func main() {
	var c config
	var gws string
	flag.IntVar(&c.nodes, "nodes", 300, "simulated nodes")
	flag.StringVar(&gws, "gateways", "1,3", "gateway counts to measure")
	flag.IntVar(&c.concurrency, "concurrency", 16, "concurrent creators (each creates one command or job at a time)")
	flag.IntVar(&c.riverWorkers, "river-workers", 100, "River: MaxWorkers of the working client")
	flag.DurationVar(&c.warmup, "warmup", 5*time.Second, "load before the measuring window")
	flag.DurationVar(&c.window, "window", 20*time.Second, "measuring window")
	flag.DurationVar(&c.drain, "drain", 60*time.Second, "after the window, wait this long at most for the backlog")
	flag.StringVar(&c.producer, "producer", "sql", "leasehold commands: sql (one INSERT each, like River's Insert) or api (ControlService.CreateCommand)")
	flag.StringVar(&c.jsonPath, "json", "", "write the result as JSON to this file")
	flag.StringVar(&c.binDir, "bin", "", "use prebuilt leasehold-<service> binaries from this directory (default: build)")
	flag.BoolVar(&c.durable, "durable", true, "local PostgreSQL with fsync and synchronous_commit on")
	flag.BoolVar(&c.river, "river", true, "measure River too")
	flag.Parse()
	for _, g := range strings.Split(gws, ",") {
		var n int
		if _, err := fmt.Sscan(strings.TrimSpace(g), &n); err != nil || n < 1 {
			fmt.Fprintf(os.Stderr, "throughput: bad -gateways %q\n", gws)
			os.Exit(2)
		}
		c.gateways = append(c.gateways, n)
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
		Concurrency: c.concurrency, Producer: c.producer, Window: c.window.Seconds()}
	binDir := c.binDir
	for _, g := range c.gateways {
		m, dir, err := leasehold(ctx, c, srv, g, binDir, started)
		if err != nil {
			return nil, err
		}
		if binDir == "" {
			binDir = dir // build once
		}
		r.Results = append(r.Results, m)
	}
	if binDir != c.binDir {
		defer os.RemoveAll(binDir)
	}
	if c.river {
		m, err := riverRun(ctx, c, srv, sup)
		if err != nil {
			return nil, err
		}
		r.Results = append(r.Results, m)
		for _, lm := range r.Results {
			if lm.System == "leasehold" && m.CompletedPS > 0 {
				if lm.Gateways == 3 {
					r.Ratio = lm.CompletedPS / m.CompletedPS
				}
				if lm.Gateways == 1 {
					r.Ratio1 = lm.CompletedPS / m.CompletedPS
				}
			}
		}
	}
	return r, nil
}

func leasehold(ctx context.Context, c config, srv *harness.Server, gateways int, binDir string, started func(*fleet.Fleet)) (measurement, string, error) {
	m := measurement{System: "leasehold", Gateways: gateways}
	f, err := fleet.Start(ctx, fleet.Options{Gateways: gateways, Timings: fleet.Real, NoAPI: c.producer != "api",
		MaxConns: c.nodes + 100, BinDir: binDir, Server: srv, Durable: c.durable, Log: logf})
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
	defer f.Close(false)
	if err != nil {
		return m, dir, err
	}
	ids, creds, err := harness.RegisterNodes(ctx, f.DB.Pool, "node", c.nodes)
	if err != nil {
		return m, dir, err
	}
	sim := &fleet.Sim{}
	for i := range ids {
		if _, err := sim.Add(f.Address(), ids[i], creds[i], nodev1.NodeKind_NODE_KIND_NODE); err != nil {
			return m, dir, err
		}
	}
	simCtx, stop := context.WithCancel(ctx)
	defer func() { stop(); sim.Wait() }()
	go sim.Start(simCtx, 200*gateways)
	if err := poll(ctx, 2*time.Minute, func() bool { return sim.Connected() == c.nodes }); err != nil {
		return m, dir, fmt.Errorf("nodes did not connect: %w", err)
	}
	prod := f.NewProducer(c.producer == "api")
	defer prod.Close()
	count := func() int64 {
		var n int64
		_ = f.DB.Pool.QueryRow(ctx, `SELECT count(*) /*bench*/ FROM commands WHERE state = 'succeeded'`).Scan(&n)
		return n
	}
	logf("leasehold, %d gateway(s): %d creators for %s + %s", gateways, c.concurrency, c.warmup, c.window)
	created, cps, done, err := measure(ctx, c, func(ctx context.Context) error {
		return prod.Create(ctx, ids[rand.IntN(len(ids))])
	}, count)
	if err != nil {
		return m, dir, err
	}
	m.Created, m.CreatedPS, m.Completed, m.CompletedPS = created, cps, done, float64(done)/c.window.Seconds()
	_ = poll(ctx, c.drain, func() bool { return count() == created })
	_ = f.DB.Pool.QueryRow(ctx, `SELECT count(*) /*bench*/ FROM commands WHERE state <> 'succeeded'`).Scan(&m.Unfinished)
	m.Latency, err = latencies(ctx, f.DB, `SELECT extract(epoch FROM finished_at - created_at) /*bench*/ FROM commands WHERE state = 'succeeded'`)
	logf("  %.0f created/s, %.0f completed/s, latency %s", m.CreatedPS, m.CompletedPS, m.Latency)
	return m, dir, err
}

func riverRun(ctx context.Context, c config, srv *harness.Server, sup *harness.Supervisor) (measurement, error) {
	m := measurement{System: "River"}
	db, err := srv.CreateDatabase(ctx, "river")
	if err != nil {
		return m, err
	}
	defer db.Drop()
	migrator, err := rivermigrate.New(riverpgxv5.New(db.Pool), &rivermigrate.Config{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
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
	}, "-database-url", db.URL, "-id", "river-worker", "-mode", "work", "-workers", fmt.Sprint(c.riverWorkers))
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
	client, err := river.NewClient(riverpgxv5.New(db.Pool), &river.Config{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		return m, err
	}
	count := func() int64 {
		var n int64
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) /*bench*/ FROM river_job WHERE state = 'completed'`).Scan(&n)
		return n
	}
	logf("River: %d inserters for %s + %s, worker process with MaxWorkers %d", c.concurrency, c.warmup, c.window, c.riverWorkers)
	var seq atomic.Int64
	created, cps, done, err := measure(ctx, c, func(ctx context.Context) error {
		_, err := client.Insert(ctx, noopArgs{N: int(seq.Add(1))}, nil)
		return err
	}, count)
	if err != nil {
		return m, err
	}
	m.Created, m.CreatedPS, m.Completed, m.CompletedPS = created, cps, done, float64(done)/c.window.Seconds()
	_ = poll(ctx, c.drain, func() bool { return count() == created })
	_ = db.Pool.QueryRow(ctx, `SELECT count(*) /*bench*/ FROM river_job WHERE state <> 'completed'`).Scan(&m.Unfinished)
	m.Latency, err = latencies(ctx, db, `SELECT extract(epoch FROM finalized_at - created_at) /*bench*/ FROM river_job WHERE state = 'completed'`)
	logf("  %.0f inserted/s, %.0f completed/s, latency %s", m.CreatedPS, m.CompletedPS, m.Latency)
	return m, err
}

// noopArgs matches riverclient's NoopArgs (kind bench_noop).
type noopArgs struct {
	N int `json:"n"`
}

func (noopArgs) Kind() string { return "bench_noop" }

// measure runs creators for warmup+window and returns what they created,
// the creation rate, and completions counted over the window.
func measure(ctx context.Context, c config, create func(context.Context) error, completed func() int64) (int64, float64, int64, error) {
	cctx, stop := context.WithCancel(ctx)
	var n, errs atomic.Int64
	var firstErr atomic.Value
	var wg sync.WaitGroup
	start := time.Now()
	for range c.concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for cctx.Err() == nil {
				rctx, cancel := context.WithTimeout(context.WithoutCancel(cctx), 10*time.Second)
				err := create(rctx)
				cancel()
				if err != nil {
					if errs.Add(1) == 1 {
						firstErr.Store(err)
					}
					continue
				}
				n.Add(1)
			}
		}()
	}
	_ = harness.Sleep(ctx, c.warmup)
	c0 := completed()
	_ = harness.Sleep(ctx, c.window)
	c1 := completed()
	stop()
	wg.Wait()
	el := time.Since(start).Seconds()
	if e := errs.Load(); e > 0 {
		logf("  %d create errors, first: %v", e, firstErr.Load())
	}
	return n.Load(), float64(n.Load()) / el, c1 - c0, ctx.Err()
}

func latencies(ctx context.Context, db *harness.Database, sql string) (harness.Dist, error) {
	rows, err := db.Pool.Query(ctx, sql)
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
	fmt.Fprintln(w, "| system | gateways | created/s | completed/s | latency p50 | latency p99 | unfinished after drain |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|")
	rs := slices.Clone(r.Results)
	for _, m := range rs {
		g := "-"
		if m.Gateways > 0 {
			g = fmt.Sprint(m.Gateways)
		}
		fmt.Fprintf(w, "| %s | %s | %.0f | %.0f | %.3f s | %.3f s | %d |\n", m.System, g, m.CreatedPS, m.CompletedPS, m.Latency.P50, m.Latency.P99, m.Unfinished)
	}
	if r.Ratio1 > 0 || r.Ratio > 0 {
		fmt.Fprintf(w, "\nratio leasehold/River (completed/s): 1 gateway %.2f, 3 gateways %.2f\n", r.Ratio1, r.Ratio)
	}
}
