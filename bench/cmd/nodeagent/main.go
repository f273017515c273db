// Command nodeagent measures the real node agent (leasehold-node) against
// its targets on a real stack: PostgreSQL, gateways, the api and
// leasehold-node processes, all built from this tree.
//
//   - idle: the agent's RSS (VmRSS, max and final) and CPU (utime+stime, as
//     % of one core) over -idle with a live session and nothing to do.
//     Targets: RSS <= 15 MiB, CPU <= 0.1% of a core.
//   - exec: -execs commands `exec /bin/true`, one at a time after
//     -warmup-execs, each timed from CreateCommand sent until WaitCommand
//     returns it terminal, and broken into phases by the command's own
//     timestamps (created_at, the result's started_at, finished_at and
//     received_at, updated_at). Target: p50 <= 50 ms on an idle stack.
//   - output: one command writing -output-bytes (head -c N /dev/urandom, or
//     /dev/zero with -output-source zero) read by a live
//     StreamCommandOutput reader opened right after the create, once
//     through a gateway with the default --gateway.output-cap (the first
//     MiB stored, the rest relayed live from the gateway) and the agent's
//     default --output.max-bytes, once with both raised to -big-cap
//     (everything stored): bytes the reader got, MiB/s first to last byte,
//     what PostgreSQL holds afterwards, and the CPU, WAL and statements it
//     cost. Target: the whole output reaches a live reader at >= 50 MiB/s
//     while PostgreSQL keeps only a bounded part.
//
// Two gateways and two agents run: agent 0 on gateway 0 (default caps), on
// which idle and exec are measured, and agent 1 on gateway 1 (caps raised),
// used by the second output run only. Each agent dials its gateway
// directly, without a balancer.
package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/leasehold/leasehold/bench/internal/harness"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
)

type config struct {
	idle                         time.Duration
	execs, warmupExecs           int
	outputBytes, bigCap          int64
	outputSource                 string
	phases                       map[string]bool
	jsonPath, binDir             string
	durable, keep, gate          bool
	agentArgs, gatewayArgs       []string
	idleSample                   time.Duration
	rssTargetMiB, cpuTargetPct   float64
	execTargetP50, rateTargetMiB float64
}

// idleResult is one agent's footprint over the idle window.
type idleResult struct {
	Agent      string  `json:"agent"`
	WindowS    float64 `json:"window_s"`
	RSSMaxKiB  int64   `json:"rss_max_kib"`
	RSSLastKiB int64   `json:"rss_final_kib"`
	// RssAnon and RssFile split the final VmRSS: anonymous memory (heap,
	// stacks, runtime) and file pages (the binary's text and data).
	RSSAnonKiB int64 `json:"rss_anon_final_kib"`
	RSSFileKiB int64 `json:"rss_file_final_kib"`
	// PSS (smaps_rollup) shares the binary\'s file pages among the agents
	// that map it: what one agent costs the machine beside another.
	PSSKiB   int64   `json:"pss_final_kib"`
	CPUPct   float64 `json:"cpu_pct_of_one_core"`
	CPUTicks int64   `json:"cpu_ticks"`
	// Go runtime figures from the agent's /metrics at the window's end.
	Runtime   map[string]float64 `json:"runtime,omitempty"`
	LoadStart string             `json:"load_average_start"`
	LoadEnd   string             `json:"load_average_end"`
	RSSOK     bool               `json:"rss_target_met"`
	CPUOK     bool               `json:"cpu_target_met"`
}

// execResult is the create-to-done latency of exec /bin/true and its phases.
type execResult struct {
	N int `json:"n"`
	// Latency is CreateCommand sent until WaitCommand returned it terminal.
	Latency harness.Dist `json:"latency_create_to_done"`
	// Phases, from the command's timestamps (database and node clocks, one
	// machine): create = sent .. created_at; dispatch = created_at ..
	// started_at; exec = started_at .. finished_at; report = finished_at ..
	// received_at; record = received_at .. updated_at; wait = updated_at ..
	// WaitCommand returned.
	Phases map[string]harness.Dist `json:"phases"`
	// Per command, over the measured commands.
	PGCPUms    float64                 `json:"pg_cpu_ms_per_command"`
	Statements float64                 `json:"statements_per_command"`
	WALBytes   float64                 `json:"wal_bytes_per_command"`
	AgentCPUms float64                 `json:"agent_cpu_ms_per_command"`
	GatewayMs  float64                 `json:"gateway_cpu_ms_per_command"`
	APIms      float64                 `json:"api_cpu_ms_per_command"`
	Costliest  []harness.StatementCost `json:"costliest_statements,omitempty"`
	LoadStart  string                  `json:"load_average_start"`
	LoadEnd    string                  `json:"load_average_end"`
	OK         bool                    `json:"p50_target_met"`
}

// outputResult is one run of the output scenario.
type outputResult struct {
	Label       string  `json:"label"`
	GatewayCap  int64   `json:"gateway_output_cap"`
	AgentMax    int64   `json:"agent_output_max_bytes"`
	Written     int64   `json:"written_bytes"`
	Source      string  `json:"source"`
	Received    int64   `json:"reader_bytes"`
	Truncated   bool    `json:"reader_got_truncation_marker"`
	TruncatedAt int64   `json:"truncation_offset,omitempty"`
	Streams     int     `json:"stream_calls"`
	FirstByteS  float64 `json:"first_byte_after_create_s"`
	LastByteS   float64 `json:"last_byte_after_create_s"`
	ReaderMiBps float64 `json:"reader_mib_per_s_first_to_last"`
	DoneS       float64 `json:"wait_done_after_create_s"`
	NodeExecS   float64 `json:"node_started_to_finished_s"`
	StoreSpanS  float64 `json:"stored_first_to_last_s"`
	StoreMiBps  float64 `json:"stored_mib_per_s"`
	Rows        int64   `json:"pg_rows"`
	RowBytes    int64   `json:"pg_data_bytes"`
	RowStoredB  int64   `json:"pg_data_column_size_bytes"`
	TableBytes  int64   `json:"pg_command_output_total_relation_bytes"`
	WALBytes    int64   `json:"pg_wal_bytes"`
	PGCPUs      float64 `json:"pg_cpu_s"`
	GatewayCPUs float64 `json:"gateway_cpu_s"`
	APICPUs     float64 `json:"api_cpu_s"`
	AgentCPUs   float64 `json:"agent_cpu_s"`
	BenchCPUs   float64 `json:"bench_reader_cpu_s"`
	WallS       float64 `json:"wall_s"`
	// Largest VmRSS seen (sampled every 100 ms) while the output flowed.
	GatewayRSSMaxKiB int64                   `json:"gateway_rss_max_kib"`
	APIRSSMaxKiB     int64                   `json:"api_rss_max_kib"`
	AgentRSSMaxKiB   int64                   `json:"agent_rss_max_kib"`
	Statements       []harness.StatementCost `json:"costliest_statements,omitempty"`
	LoadStart        string                  `json:"load_average_start"`
	LoadEnd          string                  `json:"load_average_end"`
	TargetMet        bool                    `json:"target_met"`
	State            string                  `json:"command_state"`
}

type result struct {
	Machine  string         `json:"machine"`
	Database string         `json:"database"`
	Date     string         `json:"date"`
	Command  string         `json:"command"`
	Idle     []idleResult   `json:"idle,omitempty"`
	Exec     *execResult    `json:"exec,omitempty"`
	Output   []outputResult `json:"output,omitempty"`
}

// logf is harness.Logf.
var logf = harness.Logf

func main() {
	var c config
	var phases, jsonPath string
	flag.DurationVar(&c.idle, "idle", 60*time.Second, "idle window: RSS and CPU of an agent with a live session and nothing to do")
	flag.DurationVar(&c.idleSample, "idle-sample", time.Second, "how often RSS is read during the idle window")
	flag.IntVar(&c.execs, "execs", 200, "exec /bin/true commands measured, one at a time")
	flag.IntVar(&c.warmupExecs, "warmup-execs", 20, "exec /bin/true commands run first and not measured")
	flag.Int64Var(&c.outputBytes, "output-bytes", 100<<20, "bytes the output command writes")
	flag.StringVar(&c.outputSource, "output-source", "urandom", "what the output command writes: urandom (incompressible, PostgreSQL stores every byte) or zero (compresses to almost nothing in TOAST)")
	flag.Int64Var(&c.bigCap, "big-cap", 128<<20, "second output run: --gateway.output-cap and the agent's --output.max-bytes raised to this (0: skip it)")
	flag.StringVar(&phases, "phases", "idle,exec,output", "what to measure, comma-separated: idle, exec, output")
	flag.StringVar(&c.jsonPath, "out", "", "write the result as JSON to this file")
	flag.StringVar(&jsonPath, "json", "", "same as -out")
	flag.StringVar(&c.binDir, "bin", "", "use prebuilt leasehold-<service> binaries from this directory (default: build)")
	flag.BoolVar(&c.durable, "durable", true, "local PostgreSQL with fsync and synchronous_commit on")
	flag.BoolVar(&c.keep, "keep", false, "keep the work directory (process logs, agents' state)")
	flag.BoolVar(&c.gate, "gate", false, "exit 1 when a measured target is missed (default: report only)")
	flag.Float64Var(&c.rssTargetMiB, "rss-target-mib", 15, "idle RSS target")
	flag.Float64Var(&c.cpuTargetPct, "cpu-target-pct", 0.1, "idle CPU target, % of one core")
	flag.Float64Var(&c.execTargetP50, "exec-target-p50", 0.050, "exec create-to-done p50 target, seconds")
	flag.Float64Var(&c.rateTargetMiB, "output-target-mibps", 50, "output target: MiB/s to a live reader, the whole output")
	flag.Func("agent-arg", "an extra leasehold-node flag for both agents, e.g. --output-flush=50ms (repeatable)", func(v string) error {
		c.agentArgs = append(c.agentArgs, v)
		return nil
	})
	flag.Func("gateway-arg", "an extra gateway flag for both gateways (repeatable)", func(v string) error {
		c.gatewayArgs = append(c.gatewayArgs, v)
		return nil
	})
	flag.Parse()
	if c.jsonPath == "" {
		c.jsonPath = jsonPath
	}
	c.phases = map[string]bool{}
	for _, p := range strings.Split(phases, ",") {
		switch p = strings.TrimSpace(p); p {
		case "idle", "exec", "output":
			c.phases[p] = true
		case "":
		default:
			fmt.Fprintf(os.Stderr, "nodeagent: unknown phase %q\n", p)
			os.Exit(2)
		}
	}
	if c.outputSource != "urandom" && c.outputSource != "zero" {
		fmt.Fprintf(os.Stderr, "nodeagent: -output-source %q: urandom or zero\n", c.outputSource)
		os.Exit(2)
	}
	sup := &harness.Supervisor{}
	ctx, cancel := harness.SignalContext(sup.Stop)
	defer cancel()
	res, err := run(ctx, c, sup)
	if res != nil {
		res.print(os.Stdout, c)
		if werr := harness.WriteJSON(c.jsonPath, res); werr != nil {
			fmt.Fprintln(os.Stderr, "nodeagent: write json:", werr)
			os.Exit(2)
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "nodeagent:", err)
		os.Exit(2)
	}
	if c.gate && res.missed() {
		fmt.Fprintln(os.Stderr, "nodeagent: a target was missed")
		os.Exit(1)
	}
}

// missed reports whether a measured target was missed.
func (r *result) missed() bool {
	for _, i := range r.Idle {
		if !i.RSSOK || !i.CPUOK {
			return true
		}
	}
	if r.Exec != nil && !r.Exec.OK {
		return true
	}
	for _, o := range r.Output {
		if !o.TargetMet {
			return true
		}
	}
	return false
}

// stack is the running control plane and agents.
type stack struct {
	srv      *harness.Server
	db       *harness.Database
	gateways []*harness.Proc
	api      *harness.Proc
	agents   []*harness.Proc
	nodeIDs  []string
	client   controlv1connect.ControlServiceClient
	token    string
}

func startStack(ctx context.Context, c config, sup *harness.Supervisor, dir string) (*stack, error) {
	s := &stack{}
	logf("building gateway, api and node into %s", dir)
	bins, err := harness.Binaries(dir, c.binDir, "gateway", "api", "node")
	if err != nil {
		return nil, err
	}
	logf("starting PostgreSQL")
	if s.srv, err = harness.StartServer(ctx, c.durable); err != nil {
		return nil, err
	}
	if s.db, err = s.srv.CreateDatabase(ctx, "nodeagent"); err != nil {
		return s, err
	}
	common := func(name string) []string {
		return []string{"--database-url", s.db.URL, "--http-addr", harness.FreeAddr(), "--id", name, "--log-format", "text", "--log-level", "warn"}
	}
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	s.token = hex.EncodeToString(b)
	tokens := filepath.Join(dir, "tokens")
	if err := os.WriteFile(tokens, []byte("admin:"+s.token+"\n"), 0o600); err != nil {
		return s, err
	}
	// The gateways relay live output past their stored cap to the api
	// (as they relay tunnels), authenticated by a shared token.
	relayToken := filepath.Join(dir, "relay-token")
	if err := os.WriteFile(relayToken, []byte(hex.EncodeToString(b)+"-relay\n"), 0o600); err != nil {
		return s, err
	}
	apiAddr := harness.FreeAddr()
	if s.api, err = sup.Start("api-1", bins["api"], nil, append(common("api-1"), "--listen-addr", apiAddr, "--tokens-file", tokens,
		"--api.relay-token-file", relayToken)...); err != nil {
		return s, err
	}
	if err := s.api.WaitReady(ctx, 60*time.Second); err != nil {
		return s, err
	}
	s.client = controlv1connect.NewControlServiceClient(http.DefaultClient, "http://"+apiAddr, connect.WithInterceptors(bearer(s.token)))
	ids, creds, err := harness.RegisterNodes(ctx, s.db.Pool, "agent", 2)
	if err != nil {
		return s, err
	}
	s.nodeIDs = ids
	// Gateway 0 and agent 0 keep the defaults; gateway 1 and agent 1 have
	// the output caps raised (second output run).
	for i := range 2 {
		name := fmt.Sprintf("gw-%d", i)
		listen := harness.FreeAddr()
		args := append(common(name), "--listen-addr", listen, "--gateway.relay-listen-addr", harness.FreeAddr(), "--gateway.relay-token-file", relayToken)
		agentArgs := []string{}
		if i == 1 && c.bigCap > 0 {
			args = append(args, "--gateway.output-cap", strconv.FormatInt(c.bigCap, 10))
			agentArgs = append(agentArgs, "--output.max-bytes", strconv.FormatInt(c.bigCap, 10))
		}
		gw, err := sup.Start(name, bins["gateway"], nil, append(args, c.gatewayArgs...)...)
		if err != nil {
			return s, err
		}
		if err := gw.WaitReady(ctx, 60*time.Second); err != nil {
			return s, err
		}
		s.gateways = append(s.gateways, gw)
		state := filepath.Join(dir, ids[i])
		if err := os.MkdirAll(state, 0o700); err != nil {
			return s, err
		}
		if err := os.WriteFile(filepath.Join(state, "credential"), []byte(creds[i]+"\n"), 0o600); err != nil {
			return s, err
		}
		agentArgs = append([]string{"--gateway-url", "http://" + listen, "--state-dir", state, "--node-id", ids[i],
			"--http-addr", harness.FreeAddr(), "--log-format", "text", "--log-level", "warn"}, agentArgs...)
		a, err := sup.Start(ids[i], bins["node"], nil, append(agentArgs, c.agentArgs...)...)
		if err != nil {
			return s, err
		}
		if err := a.WaitReady(ctx, 60*time.Second); err != nil {
			return s, err
		}
		s.agents = append(s.agents, a)
	}
	logf("stack up: PostgreSQL, api, 2 gateways, 2 agents (%s on gw-0 with default caps, %s on gw-1 with caps %d)", ids[0], ids[1], c.bigCap)
	return s, nil
}

func run(ctx context.Context, c config, sup *harness.Supervisor) (*result, error) {
	dir, err := os.MkdirTemp("", "leasehold-nodeagent-")
	if err != nil {
		return nil, err
	}
	sup.LogDir = dir
	s, err := startStack(ctx, c, sup, dir)
	defer func() {
		sup.Stop()
		if s != nil && s.db != nil {
			s.db.Drop()
		}
		if s != nil && s.srv != nil {
			s.srv.Stop()
		}
		if c.keep {
			logf("work directory kept: %s", dir)
		} else {
			os.RemoveAll(dir)
		}
	}()
	if err != nil {
		return nil, err
	}
	r := &result{Machine: harness.Host(), Database: s.srv.Desc, Date: time.Now().UTC().Format(time.RFC3339),
		Command: strings.Join(os.Args, " ")}
	if c.phases["idle"] {
		// Let the start settle (first heartbeats, GC of the start's garbage).
		_ = harness.Sleep(ctx, 5*time.Second)
		ir, err := measureIdle(ctx, c, s)
		r.Idle = ir
		if err != nil {
			return r, err
		}
	}
	if c.phases["exec"] {
		er, err := measureExec(ctx, c, s)
		r.Exec = er
		if err != nil {
			return r, err
		}
	}
	if c.phases["output"] {
		for i, label := range []string{"default caps", "caps raised"} {
			if i == 1 && c.bigCap <= 0 {
				break
			}
			or, err := measureOutput(ctx, c, s, i, label)
			if err != nil {
				return r, err
			}
			r.Output = append(r.Output, *or)
		}
	}
	return r, nil
}

// ---- idle ----

func measureIdle(ctx context.Context, c config, s *stack) ([]idleResult, error) {
	logf("idle: %s window on both agents", c.idle)
	out := make([]idleResult, len(s.agents))
	t0 := make([]int64, len(s.agents))
	for i, a := range s.agents {
		out[i] = idleResult{Agent: s.nodeIDs[i], LoadStart: harness.LoadAvg()}
		t0[i], _ = cpuTicks(a.Cmd.Process.Pid)
	}
	start := time.Now()
	tick := time.NewTicker(c.idleSample)
	defer tick.Stop()
	for time.Since(start) < c.idle {
		for i, a := range s.agents {
			if kb, err := rssKiB(a.Cmd.Process.Pid); err == nil {
				out[i].RSSMaxKiB = max(out[i].RSSMaxKiB, kb)
				out[i].RSSLastKiB = kb
			}
		}
		select {
		case <-ctx.Done():
			return out, ctx.Err()
		case <-tick.C:
		}
	}
	el := time.Since(start).Seconds()
	for i, a := range s.agents {
		t1, err := cpuTicks(a.Cmd.Process.Pid)
		if err != nil {
			return out, fmt.Errorf("%s: %w", s.nodeIDs[i], err)
		}
		if kb, err := rssKiB(a.Cmd.Process.Pid); err == nil {
			out[i].RSSMaxKiB = max(out[i].RSSMaxKiB, kb)
			out[i].RSSLastKiB = kb
		}
		o := &out[i]
		o.RSSAnonKiB, _ = statusKiB(a.Cmd.Process.Pid, "RssAnon:")
		o.RSSFileKiB, _ = statusKiB(a.Cmd.Process.Pid, "RssFile:")
		o.PSSKiB, _ = procKiB(fmt.Sprintf("/proc/%d/smaps_rollup", a.Cmd.Process.Pid), "Pss:")
		o.WindowS = el
		o.CPUTicks = t1 - t0[i]
		o.CPUPct = float64(o.CPUTicks) / 100 / el * 100
		o.LoadEnd = harness.LoadAvg()
		o.Runtime = scrapeRuntime(ctx, a)
		o.RSSOK = float64(o.RSSMaxKiB) <= c.rssTargetMiB*1024
		o.CPUOK = o.CPUPct <= c.cpuTargetPct
		logf("  %s: RSS max %.1f MiB final %.1f MiB (anon %.1f, file %.1f; PSS %.1f), CPU %.3f%% of a core (%d ticks in %.0f s); heap in use %.1f MiB, goroutines %.0f (load %s .. %s)",
			o.Agent, float64(o.RSSMaxKiB)/1024, float64(o.RSSLastKiB)/1024, float64(o.RSSAnonKiB)/1024, float64(o.RSSFileKiB)/1024, float64(o.PSSKiB)/1024, o.CPUPct, o.CPUTicks, el,
			o.Runtime["go_memstats_heap_inuse_bytes"]/(1<<20), o.Runtime["go_goroutines"], o.LoadStart, o.LoadEnd)
	}
	return out, nil
}

// runtimeMetrics are the agent's /metrics series kept for the report.
var runtimeMetrics = []string{"go_goroutines", "go_threads", "go_memstats_heap_inuse_bytes", "go_memstats_heap_sys_bytes",
	"go_memstats_heap_idle_bytes", "go_memstats_heap_released_bytes", "go_memstats_stack_inuse_bytes", "go_memstats_sys_bytes",
	"go_memstats_next_gc_bytes", "process_resident_memory_bytes", "go_gc_gogc_percent", "go_gc_gomemlimit_bytes"}

func scrapeRuntime(ctx context.Context, p *harness.Proc) map[string]float64 {
	code, body, err := p.Get(ctx, "/metrics")
	if err != nil || code != http.StatusOK {
		return nil
	}
	want := map[string]bool{}
	for _, m := range runtimeMetrics {
		want[m] = true
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 2 && want[f[0]] {
			if v, err := strconv.ParseFloat(f[1], 64); err == nil {
				out[f[0]] = v
			}
		}
	}
	return out
}

// ---- exec ----

func measureExec(ctx context.Context, c config, s *stack) (*execResult, error) {
	node := s.nodeIDs[0]
	logf("exec: %d warm-up + %d measured `exec /bin/true` on %s, one at a time", c.warmupExecs, c.execs, node)
	for range c.warmupExecs {
		if _, err := execOnce(ctx, s, node); err != nil {
			return nil, err
		}
	}
	r := &execResult{N: c.execs, LoadStart: harness.LoadAvg(), Phases: map[string]harness.Dist{}}
	_ = s.db.ResetStatements(ctx)
	c0 := sampleCosts(ctx, s)
	var lat []time.Duration
	ph := map[string][]time.Duration{}
	for range c.execs {
		t, err := execOnce(ctx, s, node)
		if err != nil {
			return r, err
		}
		lat = append(lat, t.total)
		for k, v := range t.phases {
			ph[k] = append(ph[k], v)
		}
	}
	c1 := sampleCosts(ctx, s)
	r.LoadEnd = harness.LoadAvg()
	r.Latency = harness.Summarize(lat)
	for k, v := range ph {
		r.Phases[k] = harness.Summarize(v)
	}
	n := float64(c.execs)
	r.PGCPUms = (c1.pgCPU - c0.pgCPU) * 1000 / n
	r.Statements = float64(c1.stmts-c0.stmts) / n
	r.WALBytes = float64(c1.wal-c0.wal) / n
	r.AgentCPUms = float64(c1.agent[0]-c0.agent[0]) * 10 / n
	r.GatewayMs = float64(c1.gateway[0]-c0.gateway[0]) * 10 / n
	r.APIms = float64(c1.api-c0.api) * 10 / n
	r.Costliest, _ = s.db.CostliestStatements(ctx, 8)
	r.OK = r.Latency.P50 <= c.execTargetP50
	logf("  create->done p50 %.1f ms p90 %.1f ms p99 %.1f ms max %.1f ms (load %s .. %s)", r.Latency.P50*1000, r.Latency.P90*1000,
		r.Latency.P99*1000, r.Latency.Max*1000, r.LoadStart, r.LoadEnd)
	for _, k := range execPhases {
		d := r.Phases[k]
		logf("    %-8s p50 %6.1f ms  p90 %6.1f ms  p99 %6.1f ms", k, d.P50*1000, d.P90*1000, d.P99*1000)
	}
	logf("  per command: PostgreSQL CPU %.2f ms, %.1f statements, %.0f WAL bytes; CPU agent %.2f ms, gateway %.2f ms, api %.2f ms",
		r.PGCPUms, r.Statements, r.WALBytes, r.AgentCPUms, r.GatewayMs, r.APIms)
	return r, nil
}

// execPhases are the phases of one exec, in order.
var execPhases = []string{"create", "dispatch", "exec", "report", "record", "wait"}

type execTiming struct {
	total  time.Duration
	phases map[string]time.Duration
}

// execPayload is the protojson of nodev1.ExecPayload{argv: ["/bin/true"]}.
const execPayload = `{"argv":["/bin/true"]}`

func execOnce(ctx context.Context, s *stack, node string) (execTiming, error) {
	sent := time.Now()
	cr, err := s.client.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: node, Kind: "exec", Payload: []byte(execPayload)}))
	if err != nil {
		return execTiming{}, fmt.Errorf("create: %w", err)
	}
	w, err := waitTerminal(ctx, s, cr.Msg.GetCommand().GetId())
	if err != nil {
		return execTiming{}, err
	}
	done := time.Now()
	cmd, res := w.GetCommand(), w.GetResult()
	if cmd.GetState() != controlv1.CommandState_COMMAND_STATE_SUCCEEDED {
		return execTiming{}, fmt.Errorf("command %s ended %s: %s", cmd.GetId(), cmd.GetState(), res.GetError())
	}
	created, started, finished := cmd.GetCreatedAt().AsTime(), res.GetStartedAt().AsTime(), res.GetFinishedAt().AsTime()
	received, updated := res.GetReceivedAt().AsTime(), cmd.GetUpdatedAt().AsTime()
	return execTiming{total: done.Sub(sent), phases: map[string]time.Duration{
		"create": created.Sub(sent), "dispatch": started.Sub(created), "exec": finished.Sub(started),
		"report": received.Sub(finished), "record": updated.Sub(received), "wait": done.Sub(updated)}}, nil
}

func terminal(st controlv1.CommandState) bool {
	switch st {
	case controlv1.CommandState_COMMAND_STATE_SUCCEEDED, controlv1.CommandState_COMMAND_STATE_FAILED,
		controlv1.CommandState_COMMAND_STATE_CANCELLED, controlv1.CommandState_COMMAND_STATE_EXPIRED:
		return true
	}
	return false
}

// waitTerminal calls WaitCommand (default timeout) until the command is terminal.
func waitTerminal(ctx context.Context, s *stack, id string) (*controlv1.WaitCommandResponse, error) {
	deadline := time.Now().Add(10 * time.Minute)
	for time.Now().Before(deadline) {
		w, err := s.client.WaitCommand(ctx, connect.NewRequest(&controlv1.WaitCommandRequest{CommandId: id}))
		if err != nil {
			return nil, fmt.Errorf("wait %s: %w", id, err)
		}
		if terminal(w.Msg.GetCommand().GetState()) {
			return w.Msg, nil
		}
	}
	return nil, fmt.Errorf("command %s not terminal after 10 minutes", id)
}

// ---- output ----

func measureOutput(ctx context.Context, c config, s *stack, agent int, label string) (*outputResult, error) {
	node := s.nodeIDs[agent]
	r := &outputResult{Label: label, GatewayCap: 1 << 20, AgentMax: 256 << 20, Written: c.outputBytes, Source: c.outputSource, LoadStart: harness.LoadAvg()}
	if agent == 1 {
		r.GatewayCap, r.AgentMax = c.bigCap, c.bigCap
	}
	logf("output (%s): exec head -c %d /dev/%s on %s, one live StreamCommandOutput reader", label, c.outputBytes, c.outputSource, node)
	_ = s.db.ResetStatements(ctx)
	c0 := sampleCosts(ctx, s)
	var bench0 syscallTimes
	bench0.read()
	sampled := make(chan [3]int64, 1)
	sctx, stopSampling := context.WithCancel(ctx)
	defer stopSampling()
	go func() {
		var m [3]int64
		pids := []int{s.gateways[agent].Cmd.Process.Pid, s.api.Cmd.Process.Pid, s.agents[agent].Cmd.Process.Pid}
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			for i, pid := range pids {
				if kb, err := rssKiB(pid); err == nil {
					m[i] = max(m[i], kb)
				}
			}
			select {
			case <-sctx.Done():
				sampled <- m
				return
			case <-t.C:
			}
		}
	}()
	payload := fmt.Sprintf(`{"argv":["head","-c","%d","/dev/%s"]}`, c.outputBytes, c.outputSource)
	start := time.Now()
	cr, err := s.client.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: node, Kind: "exec", Payload: []byte(payload)}))
	if err != nil {
		return nil, fmt.Errorf("create: %w", err)
	}
	id := cr.Msg.GetCommand().GetId()
	type readDone struct {
		first, last time.Time
		n           int64
		trunc       bool
		truncAt     int64
		calls       int
		err         error
	}
	rd := make(chan readDone, 1)
	go func() {
		var d readDone
		var offset int64
		for {
			d.calls++
			st, err := s.client.StreamCommandOutput(ctx, connect.NewRequest(&controlv1.StreamCommandOutputRequest{CommandId: id, Offset: offset}))
			if err != nil {
				d.err = err
				break
			}
			for st.Receive() {
				m := st.Msg()
				if m.GetTruncated() {
					d.trunc, d.truncAt = true, m.GetOffset()
					continue
				}
				if len(m.GetData()) == 0 {
					continue
				}
				now := time.Now()
				if d.first.IsZero() {
					d.first = now
				}
				d.last = now
				if m.GetOffset() != offset {
					d.err = fmt.Errorf("piece at offset %d, want %d", m.GetOffset(), offset)
					break
				}
				offset += int64(len(m.GetData()))
				d.n = offset
			}
			err = st.Err()
			_ = st.Close()
			if d.err != nil {
				break
			}
			if connect.CodeOf(err) == connect.CodeDeadlineExceeded || connect.CodeOf(err) == connect.CodeUnavailable {
				continue // the call's time ran out: resume from the offset
			}
			d.err = err
			break
		}
		rd <- d
	}()
	w, err := waitTerminal(ctx, s, id)
	if err != nil {
		stopSampling()
		return nil, err
	}
	r.DoneS = time.Since(start).Seconds()
	var d readDone
	select {
	case d = <-rd:
	case <-time.After(10 * time.Minute):
		stopSampling()
		return nil, errors.New("output reader did not finish within 10 minutes of the command")
	}
	if d.err != nil {
		stopSampling()
		return nil, fmt.Errorf("read output: %w", d.err)
	}
	r.WallS = time.Since(start).Seconds()
	stopSampling()
	rss := <-sampled
	r.GatewayRSSMaxKiB, r.APIRSSMaxKiB, r.AgentRSSMaxKiB = rss[0], rss[1], rss[2]
	c1 := sampleCosts(ctx, s)
	var bench1 syscallTimes
	bench1.read()
	r.LoadEnd = harness.LoadAvg()
	r.State = w.GetCommand().GetState().String()
	r.Received, r.Truncated, r.TruncatedAt, r.Streams = d.n, d.trunc, d.truncAt, d.calls
	if !d.first.IsZero() {
		r.FirstByteS, r.LastByteS = d.first.Sub(start).Seconds(), d.last.Sub(start).Seconds()
		if span := d.last.Sub(d.first).Seconds(); span > 0 {
			r.ReaderMiBps = float64(d.n) / (1 << 20) / span
		}
	}
	if res := w.GetResult(); res != nil {
		r.NodeExecS = res.GetFinishedAt().AsTime().Sub(res.GetStartedAt().AsTime()).Seconds()
	}
	var span float64
	if err := s.db.Pool.QueryRow(ctx, `SELECT count(*), coalesce(sum(length(data)), 0), coalesce(sum(pg_column_size(data)), 0),
	  coalesce(extract(epoch FROM max(stored_at) - min(stored_at)), 0)::float8 /*bench*/ FROM command_output WHERE command_id = $1`, id).
		Scan(&r.Rows, &r.RowBytes, &r.RowStoredB, &span); err != nil {
		return nil, err
	}
	r.StoreSpanS = span
	if span > 0 {
		r.StoreMiBps = float64(r.RowBytes) / (1 << 20) / span
	}
	_ = s.db.Pool.QueryRow(ctx, `SELECT pg_total_relation_size('command_output') /*bench*/`).Scan(&r.TableBytes)
	r.WALBytes = c1.wal - c0.wal
	r.PGCPUs = c1.pgCPU - c0.pgCPU
	r.GatewayCPUs = float64(c1.gateway[agent]-c0.gateway[agent]) / 100
	r.APICPUs = float64(c1.api-c0.api) / 100
	r.AgentCPUs = float64(c1.agent[agent]-c0.agent[agent]) / 100
	r.BenchCPUs = bench1.secs() - bench0.secs()
	r.Statements, _ = s.db.CostliestStatements(ctx, 6)
	r.TargetMet = r.Received == c.outputBytes && r.ReaderMiBps >= c.rateTargetMiB && r.RowBytes < c.outputBytes/4
	logf("  reader got %.1f MiB (marker %v at %d) in %d call(s): first byte %.2f s, last %.2f s after create, %.1f MiB/s; command done after %.2f s (node ran it %.2f s)",
		float64(r.Received)/(1<<20), r.Truncated, r.TruncatedAt, r.Streams, r.FirstByteS, r.LastByteS, r.ReaderMiBps, r.DoneS, r.NodeExecS)
	logf("  PostgreSQL holds %d rows, %.1f MiB of data (%.1f MiB stored), stored over %.2f s (%.1f MiB/s); WAL %.1f MiB; CPU s: PostgreSQL %.2f, gateway %.2f, api %.2f, agent %.2f, bench reader %.2f (load %s .. %s)",
		r.Rows, float64(r.RowBytes)/(1<<20), float64(r.RowStoredB)/(1<<20), r.StoreSpanS, r.StoreMiBps, float64(r.WALBytes)/(1<<20),
		r.PGCPUs, r.GatewayCPUs, r.APICPUs, r.AgentCPUs, r.BenchCPUs, r.LoadStart, r.LoadEnd)
	logf("  RSS max while it flowed: gateway %.1f MiB, api %.1f MiB, agent %.1f MiB",
		float64(r.GatewayRSSMaxKiB)/1024, float64(r.APIRSSMaxKiB)/1024, float64(r.AgentRSSMaxKiB)/1024)
	for _, st := range r.Statements {
		logf("    %6d calls %9.1f ms  %s", st.Calls, st.ExecMs, st.Query)
	}
	return r, nil
}

// ---- sampling ----

type costs struct {
	pgCPU          float64
	stmts, wal     int64
	agent, gateway []int64
	api            int64
}

func sampleCosts(ctx context.Context, s *stack) costs {
	var c costs
	c.pgCPU, _ = s.srv.CPU()
	c.stmts, _ = s.db.Statements(ctx)
	// The WAL position, exact at once (pg_stat_wal, harness.WALBytes, is
	// flushed by backends about once a second and lags a short run).
	_ = s.db.Pool.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint /*bench*/`).Scan(&c.wal)
	for _, a := range s.agents {
		t, _ := cpuTicks(a.Cmd.Process.Pid)
		c.agent = append(c.agent, t)
	}
	for _, g := range s.gateways {
		t, _ := cpuTicks(g.Cmd.Process.Pid)
		c.gateway = append(c.gateway, t)
	}
	c.api, _ = cpuTicks(s.api.Cmd.Process.Pid)
	return c
}

// cpuTicks is utime+stime of pid (all its threads), in USER_HZ (1/100 s).
func cpuTicks(pid int) (int64, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(raw)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: short", pid)
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return u + st, nil
}

// rssKiB is VmRSS of pid.
func rssKiB(pid int) (int64, error) { return statusKiB(pid, "VmRSS:") }

// statusKiB is the field (e.g. "VmRSS:") of /proc/<pid>/status, in KiB.
func statusKiB(pid int, field string) (int64, error) {
	return procKiB(fmt.Sprintf("/proc/%d/status", pid), field)
}

// procKiB is the "<field> <n> kB" line of a /proc file, in KiB.
func procKiB(path, field string) (int64, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(raw), "\n") {
		if v, ok := strings.CutPrefix(l, field); ok {
			var kb int64
			_, err := fmt.Sscanf(strings.TrimSpace(v), "%d kB", &kb)
			return kb, err
		}
	}
	return 0, fmt.Errorf("%s: no %s", path, field)
}

// syscallTimes is the bench process's own CPU time.
type syscallTimes struct{ ticks int64 }

func (t *syscallTimes) read()         { t.ticks, _ = cpuTicks(os.Getpid()) }
func (t *syscallTimes) secs() float64 { return float64(t.ticks) / 100 }

type bearer string

func (b bearer) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		req.Header().Set("Authorization", "Bearer "+string(b))
		return next(ctx, req)
	}
}

func (b bearer) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		conn.RequestHeader().Set("Authorization", "Bearer "+string(b))
		return conn
	}
}

func (b bearer) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// ---- report ----

func yes(ok bool) string {
	if ok {
		return "met"
	}
	return "MISSED"
}

func (r *result) print(w io.Writer, c config) {
	fmt.Fprintf(w, "\nnodeagent: %s; machine %s; %s\n%s\n\n", r.Database, r.Machine, r.Date, r.Command)
	if len(r.Idle) > 0 {
		fmt.Fprintln(w, "| idle agent | window | RSS max | RSS final (anon + file) | CPU % of a core | heap in use | goroutines | target | load start .. end |")
		fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|")
		for _, i := range r.Idle {
			fmt.Fprintf(w, "| %s | %.0f s | %.1f MiB | %.1f MiB (%.1f + %.1f) | %.3f %% | %.1f MiB | %.0f | RSS %s, CPU %s | %s .. %s |\n", i.Agent, i.WindowS,
				float64(i.RSSMaxKiB)/1024, float64(i.RSSLastKiB)/1024, float64(i.RSSAnonKiB)/1024, float64(i.RSSFileKiB)/1024, i.CPUPct, i.Runtime["go_memstats_heap_inuse_bytes"]/(1<<20),
				i.Runtime["go_goroutines"], yes(i.RSSOK), yes(i.CPUOK), i.LoadStart, i.LoadEnd)
		}
		fmt.Fprintln(w)
	}
	if e := r.Exec; e != nil {
		fmt.Fprintf(w, "exec /bin/true, create -> done, n=%d: p50 %.1f ms, p90 %.1f ms, p99 %.1f ms, max %.1f ms (target p50 <= %.0f ms: %s; load %s .. %s)\n\n",
			e.N, e.Latency.P50*1000, e.Latency.P90*1000, e.Latency.P99*1000, e.Latency.Max*1000, c.execTargetP50*1000, yes(e.OK), e.LoadStart, e.LoadEnd)
		fmt.Fprintln(w, "| phase | p50 | p90 | p99 | max |")
		fmt.Fprintln(w, "|---|---|---|---|---|")
		for _, k := range execPhases {
			d := e.Phases[k]
			fmt.Fprintf(w, "| %s | %.1f ms | %.1f ms | %.1f ms | %.1f ms |\n", k, d.P50*1000, d.P90*1000, d.P99*1000, d.Max*1000)
		}
		fmt.Fprintf(w, "\nper command: PostgreSQL CPU %.2f ms, %.1f statements, %.0f WAL bytes; CPU agent %.2f ms, gateway %.2f ms, api %.2f ms\n\n",
			e.PGCPUms, e.Statements, e.WALBytes, e.AgentCPUms, e.GatewayMs, e.APIms)
	}
	if len(r.Output) > 0 {
		fmt.Fprintln(w, "| output run | caps (gateway / agent) | reader got | marker | MiB/s first..last byte | done after | PG rows / data | WAL | CPU s PG / gw / api / agent | target | load start .. end |")
		fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|---|")
		for _, o := range r.Output {
			fmt.Fprintf(w, "| %s, %.0f MiB %s | %.0f / %.0f MiB | %.1f MiB | %v | %.1f | %.1f s | %d / %.1f MiB | %.1f MiB | %.1f / %.1f / %.1f / %.1f | %s | %s .. %s |\n",
				o.Label, float64(o.Written)/(1<<20), o.Source, float64(o.GatewayCap)/(1<<20), float64(o.AgentMax)/(1<<20),
				float64(o.Received)/(1<<20), o.Truncated, o.ReaderMiBps, o.DoneS, o.Rows, float64(o.RowBytes)/(1<<20),
				float64(o.WALBytes)/(1<<20), o.PGCPUs, o.GatewayCPUs, o.APICPUs, o.AgentCPUs, yes(o.TargetMet), o.LoadStart, o.LoadEnd)
		}
		fmt.Fprintln(w)
	}
}
