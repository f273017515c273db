// Command runs measures runs (docs/api.md, "Runs") against single commands:
// on a fresh database with a gateway, an api and a worker process and
// -nodes in-process node daemons whose handler returns at once (a
// /bin/true that forks nothing), it times one run over every node with
// -in-flight, from CreateRun to WaitRun seeing it end, and then -nodes
// single CreateCommand + WaitCommand pairs, -in-flight at a time. For each
// it counts the database statements per node (pg_stat_statements, the
// bench's own queries left out) and reports the background rate measured
// while idle, the busiest statements, and the load average before and
// after. It prints a table and, with -json, writes the result.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/leasehold/leasehold/bench/internal/harness"
	"github.com/leasehold/leasehold/pkg/daemon"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

const token = "bench-runs-operator-token-0001"

type phase struct {
	Name          string                   `json:"name"`
	Seconds       float64                  `json:"seconds"`
	Statements    int64                    `json:"statements"`
	PerNode       float64                  `json:"statements_per_node"`
	PerNodeNet    float64                  `json:"statements_per_node_net_of_idle"`
	Top           []harness.StatementCalls `json:"top"`
	Outcome       string                   `json:"outcome"`
	Executions    int                      `json:"executions"`
	MaxConcurrent int                      `json:"max_concurrent"`
}

type result struct {
	Machine        string  `json:"machine"`
	Date           string  `json:"date"`
	Database       string  `json:"database"`
	Nodes          int     `json:"nodes"`
	InFlight       int     `json:"in_flight"`
	WorkerPoll     string  `json:"worker_poll_interval"`
	WorkerListen   bool    `json:"worker_listens"`
	IdlePerSecond  float64 `json:"idle_statements_per_second"`
	LoadBefore     string  `json:"load_before"`
	LoadAfter      string  `json:"load_after"`
	Phases         []phase `json:"phases"`
	RunOverSingles float64 `json:"run_statements_over_single"`
}

// counter counts executions and the most running at once.
type counter struct {
	mu       sync.Mutex
	running  int
	max      int
	executed int
}

func (c *counter) handle(ctx context.Context, cmd *nodev1.Command) daemon.Outcome {
	c.mu.Lock()
	c.running++
	c.executed++
	c.max = max(c.max, c.running)
	c.mu.Unlock()
	c.mu.Lock()
	c.running--
	c.mu.Unlock()
	return daemon.Outcome{}
}

func (c *counter) reset() (executed, maxRunning int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	executed, maxRunning = c.executed, c.max
	c.executed, c.max = 0, 0
	return
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

func authed[T any](m *T) *connect.Request[T] {
	r := connect.NewRequest(m)
	r.Header().Set("Authorization", "Bearer "+token)
	return r
}

// config is the bench's flags.
type config struct {
	nodes, inFlight  int
	idle, workerPoll time.Duration
	noListen         bool
	jsonPath, binDir string
}

func main() {
	var c config
	flag.IntVar(&c.nodes, "nodes", 1000, "simulated node daemons")
	flag.IntVar(&c.inFlight, "in-flight", 100, "the run's max_in_flight, and the single commands' concurrency")
	flag.DurationVar(&c.idle, "idle", 5*time.Second, "how long the background statement rate is measured")
	flag.StringVar(&c.jsonPath, "json", "", "write the result as JSON to this file")
	flag.StringVar(&c.binDir, "bin", "", "use prebuilt leasehold-* binaries from this directory (default: build)")
	flag.BoolVar(&c.noListen, "worker-no-listen", false, "run the worker with --pooler and no LISTEN URL: runs are woken by the 1 s scan and the recheck only, not by leasehold_command_done")
	flag.DurationVar(&c.workerPoll, "worker-poll", 0, "the worker's --coord.poll-interval (0: its default, 500ms): how soon an idle reconciler sees an enqueued key")
	flag.Parse()
	ctx, cancel := harness.SignalContext(func() {})
	res, err := run(ctx, c)
	if err == nil {
		err = res.report(os.Stdout, c.jsonPath)
	}
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, "runs:", err)
		os.Exit(1)
	}
}

// run starts the stack, measures the idle rate, the run and the single
// commands, and returns the result.
func run(ctx context.Context, c config) (*result, error) {
	n, inFlight, idle, workerPoll, noListen, binDir := c.nodes, c.inFlight, c.idle, c.workerPoll, c.noListen, c.binDir
	res := &result{Machine: harness.Host(), Date: time.Now().UTC().Format(time.RFC3339), Nodes: n, InFlight: inFlight, LoadBefore: loadavg(),
		WorkerPoll: "500ms (default)", WorkerListen: !noListen}
	if workerPoll > 0 {
		res.WorkerPoll = workerPoll.String()
	}
	srv, err := harness.StartServer(ctx, true)
	if err != nil {
		return nil, fmt.Errorf("start PostgreSQL: %w", err)
	}
	defer srv.Stop()
	res.Database = srv.Desc
	db, err := srv.CreateDatabase(ctx, "bench_runs")
	if err != nil {
		return nil, err
	}
	defer db.Drop()
	dir, err := os.MkdirTemp("", "leasehold-bench-runs-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	bins, err := harness.Binaries(dir, binDir, "gateway", "api", "worker")
	if err != nil {
		return nil, err
	}
	sup := &harness.Supervisor{}
	defer sup.Stop()
	gwAddr, apiAddr := harness.FreeAddr(), harness.FreeAddr()
	common := func(id string) []string {
		return []string{"--database-url", db.URL, "--http-addr", harness.FreeAddr(), "--id", id, "--log-format", "text"}
	}
	procs := []struct {
		name string
		args []string
		env  []string
	}{
		{"gateway", append(common("gw1"), "--listen-addr", gwAddr), nil},
		{"api", append(common("api1"), "--listen-addr", apiAddr, "--api.rate-limit", "0"), []string{"LEASEHOLD_API_TOKENS=operator:" + token}},
		{"worker", common("wk1"), nil},
	}
	if noListen {
		procs[2].args = append(procs[2].args, "--pooler")
	}
	if workerPoll > 0 {
		procs[2].args = append(procs[2].args, "--coord.poll-interval", workerPoll.String())
	}
	for _, p := range procs {
		pr, err := sup.Start(p.name, bins[p.name], p.env, p.args...)
		if err != nil {
			return nil, fmt.Errorf("start %s: %w", p.name, err)
		}
		if err := pr.WaitReady(ctx, time.Minute); err != nil {
			return nil, fmt.Errorf("%s not ready: %w\n%s", p.name, err, pr.Tail())
		}
	}
	ids, creds, err := harness.RegisterNodes(ctx, db.Pool, "bn", n)
	if err != nil {
		return nil, err
	}
	cnt := &counter{}
	dctx, dcancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() { dcancel(); wg.Wait() }()
	for i := range ids {
		d, err := daemon.New(daemon.Config{Address: "http://" + gwAddr, NodeID: ids[i], Credential: creds[i], Handler: cnt.handle})
		if err != nil {
			return nil, err
		}
		wg.Go(func() { _ = d.Run(dctx) })
	}
	if err := harness.Poll(ctx, 3*time.Minute, 200*time.Millisecond, func() bool {
		var c int
		_ = db.Pool.QueryRow(ctx, `/*bench*/ SELECT count(*) FROM node_sessions WHERE state = 'connected'`).Scan(&c)
		return c == n
	}); err != nil {
		return nil, fmt.Errorf("nodes did not connect: %w", err)
	}
	api := controlv1connect.NewControlServiceClient(http.DefaultClient, "http://"+apiAddr)

	// Background: heartbeats, liveness, scans, with nothing to do.
	if err := db.ResetStatements(ctx); err != nil {
		return nil, err
	}
	if err := harness.Sleep(ctx, idle); err != nil {
		return nil, err
	}
	bg, err := db.Statements(ctx)
	if err != nil {
		return nil, err
	}
	res.IdlePerSecond = float64(bg) / idle.Seconds()

	measure := func(name string, work func() (string, error)) error {
		if err := db.ResetStatements(ctx); err != nil {
			return err
		}
		cnt.reset()
		start := time.Now()
		outcome, err := work()
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		p := phase{Name: name, Seconds: time.Since(start).Seconds(), Outcome: outcome}
		if p.Statements, err = db.Statements(ctx); err != nil {
			return err
		}
		p.PerNode = float64(p.Statements) / float64(n)
		p.PerNodeNet = (float64(p.Statements) - res.IdlePerSecond*p.Seconds) / float64(n)
		if p.Top, err = db.TopStatements(ctx, 12); err != nil {
			return err
		}
		p.Executions, p.MaxConcurrent = cnt.reset()
		res.Phases = append(res.Phases, p)
		return nil
	}

	if err := measure("run", func() (string, error) {
		r, err := api.CreateRun(ctx, authed(&controlv1.CreateRunRequest{Target: &controlv1.RunTarget{NodeIds: ids},
			Kind: "bench.true", MaxInFlight: fmt.Sprint(inFlight), CommandTimeout: durationpb.New(10 * time.Minute)}))
		if err != nil {
			return "", err
		}
		for {
			w, err := api.WaitRun(ctx, authed(&controlv1.WaitRunRequest{RunId: r.Msg.GetRun().GetId(), Timeout: durationpb.New(30 * time.Second)}))
			if err != nil {
				return "", err
			}
			if s := w.Msg.GetRun().GetState(); s != controlv1.RunState_RUN_STATE_RUNNING {
				counts, _ := json.Marshal(w.Msg.GetRun().GetCounts())
				return s.String() + " " + string(counts), nil
			}
		}
	}); err != nil {
		return nil, err
	}

	if err := measure("single commands", func() (string, error) {
		work := make(chan string)
		var (
			mu     sync.Mutex
			states = map[string]int{}
			first  error
			cwg    sync.WaitGroup
		)
		for range inFlight {
			cwg.Go(func() {
				for node := range work {
					c, err := api.CreateCommand(ctx, authed(&controlv1.CreateCommandRequest{NodeId: node, Kind: "bench.true"}))
					if err == nil {
						var w *connect.Response[controlv1.WaitCommandResponse]
						w, err = api.WaitCommand(ctx, authed(&controlv1.WaitCommandRequest{CommandId: c.Msg.GetCommand().GetId(), Timeout: durationpb.New(60 * time.Second)}))
						if err == nil {
							mu.Lock()
							states[w.Msg.GetCommand().GetState().String()]++
							mu.Unlock()
						}
					}
					if err != nil {
						mu.Lock()
						if first == nil {
							first = err
						}
						mu.Unlock()
					}
				}
			})
		}
		for _, id := range ids {
			work <- id
		}
		close(work)
		cwg.Wait()
		b, _ := json.Marshal(states)
		return string(b), first
	}); err != nil {
		return nil, err
	}
	res.LoadAfter = loadavg()
	if len(res.Phases) == 2 && res.Phases[1].PerNodeNet > 0 {
		res.RunOverSingles = res.Phases[0].PerNodeNet / res.Phases[1].PerNodeNet
	}

	return res, nil
}

// report prints the table and the busiest statements, and writes the
// result as JSON when jsonPath is set.
func (res *result) report(out io.Writer, jsonPath string) error {
	n, inFlight := res.Nodes, res.InFlight
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintf(w, "runs bench: %d nodes, %d in flight, worker --coord.poll-interval %s (runs reconciler: --runs.claim-poll 100ms), %s; load average before %s, after %s\n", n, inFlight, res.WorkerPoll, res.Database, res.LoadBefore, res.LoadAfter)
	fmt.Fprintf(w, "idle background: %.0f statements/s; worker LISTENs for leasehold_command_done: %v\n", res.IdlePerSecond, res.WorkerListen)
	fmt.Fprintln(w, "phase\tseconds\tstatements\tper node\tper node net of idle\texecutions\tmax concurrent\toutcome")
	for _, p := range res.Phases {
		fmt.Fprintf(w, "%s\t%.2f\t%d\t%.1f\t%.1f\t%d\t%d\t%s\n", p.Name, p.Seconds, p.Statements, p.PerNode, p.PerNodeNet, p.Executions, p.MaxConcurrent, p.Outcome)
	}
	_ = w.Flush()
	for _, p := range res.Phases {
		fmt.Fprintf(out, "\nbusiest statements, %s:\n", p.Name)
		for _, s := range p.Top {
			fmt.Fprintf(out, "  %7d  %s\n", s.Calls, s.Query)
		}
	}
	if jsonPath != "" {
		if err := harness.WriteJSON(filepath.Clean(jsonPath), res); err != nil {
			return err
		}
	}
	return nil
}
