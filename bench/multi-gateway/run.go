package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/leasehold/leasehold/bench/internal/fleet"
	"github.com/leasehold/leasehold/bench/internal/harness"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/nodeauth"
)

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s  %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
}

func run(ctx context.Context, c config, started func(*fleet.Fleet)) (*result, error) {
	timings := fleet.Timings(c.timings)
	gwArgs := []string{"--gateway.hello-rate", fmt.Sprint(c.helloRate), "--gateway.drain-max-delay", c.drainDelay.String(),
		"--shutdown-timeout", (c.drainDelay + 30*time.Second).String(), "--gateway.max-streams", fmt.Sprint(c.maxStreams())}
	f, err := fleet.Start(ctx, fleet.Options{
		Gateways: c.gateways, Timings: timings, GatewayArgs: gwArgs, NoAPI: c.producer != "api",
		WorkerArgs: []string{"--nodes.gateway-loss-grace", c.lossGrace.String()},
		MaxConns:   c.nodes + 1000, BinDir: c.binDir, Durable: c.durable, Log: logf, Scale: c.scale,
	})
	started(f)
	defer func() {
		if c.keep {
			logf("logs kept in %s", f.Dir)
		}
		f.Close(c.keep)
	}()
	if err != nil {
		return nil, err
	}
	r := &result{Scenario: c.scenario, Nodes: c.nodes, Gateways: c.gateways, Timings: c.timings,
		Machine: harness.Host(), Database: f.Server.Desc, Date: time.Now().UTC().Format(time.RFC3339),
		Producer: map[bool]string{true: "api", false: "sql"}[c.producer == "api"], RatePerSec: c.rate,
		HelloRate: c.helloRate, LossGrace: c.lossGrace.String(), MaxStreams: c.maxStreams()}
	if timings == fleet.Real {
		r.TimingsDesc = "real time, production durations: gateway lease 20 s / renew 5 s, session lease 40 s, heartbeat 5 s, shard TTL 15 s / renew 5 s"
	} else {
		r.TimingsDesc = "fast: gateway lease 2 s / 500 ms, session lease 6 s, heartbeat 1 s, shard TTL 3 s / 1 s (shortened durations on the real clock)"
	}
	if c.scale.Rate > 1 {
		r.Timings = fmt.Sprintf("%s, scaled clock x%g", c.timings, c.scale.Rate)
		r.TimingsDesc = fmt.Sprintf("SCALED CLOCK x%g (pkg/clock): services, compute_now() and daemons run %g times faster than wall time and every duration below is in simulated seconds (the command producer's rate is per wall second); HTTP/2 pings, TCP and HAProxy checks run in wall time; ", c.scale.Rate, c.scale.Rate) + strings.TrimPrefix(r.TimingsDesc, "real time, ")
	}

	if c.siteAgents > 0 {
		startSiteAgents(ctx, f, c.siteAgents, c.binDir)
	}
	ids, creds, err := harness.RegisterNodes(ctx, f.DB.Pool, "node", c.nodes)
	if err != nil {
		return nil, err
	}
	sim := &fleet.Sim{WorkTime: 10 * time.Millisecond, Scale: c.scale}
	for i := range ids {
		if _, err := sim.Add(f.Address(), ids[i], creds[i], nodev1.NodeKind_NODE_KIND_NODE); err != nil {
			return nil, err
		}
	}
	simCtx, stopSim := context.WithCancel(ctx)
	defer func() { stopSim(); sim.Wait() }()
	logf("connecting %d nodes through HAProxy", c.nodes)
	connStart := c.now()
	go sim.Start(simCtx, int(c.helloRate)*c.gateways)
	if err := waitFor(ctx, 5*time.Minute, func() bool { return sim.Connected() == c.nodes }); err != nil {
		return nil, fmt.Errorf("only %d of %d nodes connected: %w", sim.Connected(), c.nodes, err)
	}
	r.InitialConnect = c.now().Sub(connStart).Seconds()
	logf("all %d nodes connected in %.1fs", c.nodes, r.InitialConnect)

	// Producer: commands to random nodes at a steady rate.
	prod := f.NewProducer(c.producer == "api")
	defer prod.Close()
	prodCtx, stopProd := context.WithCancel(ctx)
	var created, createErrs atomic.Int64
	var prodWG sync.WaitGroup
	prodWG.Add(1)
	go func() {
		defer prodWG.Done()
		tick := time.NewTicker(time.Duration(float64(time.Second) / c.rate))
		defer tick.Stop()
		sem := make(chan struct{}, 16)
		for {
			select {
			case <-prodCtx.Done():
				for range cap(sem) {
					sem <- struct{}{}
				}
				return
			case <-tick.C:
			}
			sem <- struct{}{}
			go func() {
				defer func() { <-sem }()
				cctx, cancel := context.WithTimeout(context.WithoutCancel(prodCtx), 10*time.Second)
				defer cancel()
				if err := prod.Create(cctx, ids[rand.IntN(len(ids))]); err != nil {
					if createErrs.Add(1) <= 3 {
						logf("create command: %v", err)
					}
					return
				}
				created.Add(1)
			}()
		}
	}()
	defer stopProd()

	// Sampler: transactions/s and false unreachable marks, once a second.
	smp := newSampler(f, sim, c.now)
	smpCtx, stopSmp := context.WithCancel(ctx)
	smpDone := make(chan struct{})
	go func() { defer close(smpDone); smp.run(smpCtx) }()
	defer func() { stopSmp(); <-smpDone }()

	logf("steady state for %s (%s, %.0f commands/s via %s)", c.warmup, c.timings, c.rate, r.Producer)
	if err := harness.Sleep(ctx, c.wall(c.warmup)); err != nil {
		return nil, err
	}

	// The fault.
	victim := f.Gateways[0]
	before := map[string]string{}
	var lost []*fleet.Node
	for _, n := range sim.Nodes {
		gw := n.Current()
		before[n.ID] = gw
		if gw == victim.Name {
			lost = append(lost, n)
		}
	}
	r.Victim, r.NodesLost, r.Survivors = victim.Name, len(lost), c.gateways-1
	r.AdmissionLimit = float64(len(lost)) / (float64(r.Survivors) * c.helloRate)
	pushbacksBefore := sim.Pushbacks()
	var pauseDBTime time.Time
	if err := f.DB.Pool.QueryRow(ctx, "SELECT compute_now() /*bench*/").Scan(&pauseDBTime); err != nil {
		return nil, err
	}
	if err := f.DB.ResetStatements(ctx); err != nil {
		logf("pg_stat_statements unavailable (%v): no statement counts in the report", err)
	}
	t0 := c.now()
	smp.markFault(t0)
	logf("%s: %s holds %d of %d nodes", c.scenario, victim.Name, len(lost), c.nodes)
	switch c.scenario {
	case "kill":
		err = victim.Proc.Signal(syscall.SIGKILL)
	case "zombie":
		err = victim.Proc.Signal(syscall.SIGSTOP)
	case "drain":
		err = victim.Proc.Signal(syscall.SIGTERM)
	}
	if err != nil {
		return nil, err
	}

	rehomed := func() int {
		k := 0
		for _, n := range lost {
			if _, ok := n.FirstWelcomeAfter(t0); ok {
				k++
			}
		}
		return k
	}
	progress := func(phase string) {
		line := fmt.Sprintf("[%s +%4.1fs] re-homed %d/%d  connected %d/%d  created %d  executed %d  pushbacks %d  xact/s %.0f",
			phase, c.now().Sub(t0).Seconds(), rehomed(), len(lost), sim.Connected(), c.nodes, created.Load(),
			sim.Executions.Load(), sim.Pushbacks()-pushbacksBefore, smp.lastRate())
		if c.progress {
			fmt.Fprintf(os.Stderr, "\r%-150s", line)
		} else {
			fmt.Fprintln(os.Stderr, time.Now().Format("15:04:05")+"  "+line)
		}
	}
	progEvery := 5 * time.Second
	if c.progress {
		progEvery = time.Second
	}
	progTick := time.NewTicker(progEvery)
	defer progTick.Stop()
	var resumed bool
	deadline := t0.Add(c.maxWait)
	for {
		el := c.now().Sub(t0)
		if c.scenario == "zombie" && !resumed && el >= c.pause {
			if err := victim.Proc.Signal(syscall.SIGCONT); err != nil {
				return nil, err
			}
			resumed = true
			// The zombie fences itself, stays up, and takes its lease
			// again at a new epoch (ready again): no restart.
			served := victim.Proc.WaitReady(ctx, 30*time.Second) == nil
			r.Zombie = &zombieResult{Paused: c.pause.Seconds(), Exited: victim.Proc.Exited(), ServedAgain: served}
			if victim.Proc.Exited() {
				r.Zombie.ExitCode = victim.Proc.ExitCode()
			}
			logf("zombie resumed after %s: exited=%v served again=%v", c.pause, r.Zombie.Exited, served)
		}
		done := rehomed() == len(lost) && el >= c.observe && (c.scenario != "zombie" || resumed)
		if c.scenario == "drain" && !victim.Proc.Exited() {
			done = false
		}
		if done || c.now().After(deadline) {
			break
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-progTick.C:
			progress(c.scenario)
		case <-time.After(100 * time.Millisecond):
		}
	}
	if c.progress {
		fmt.Fprintln(os.Stderr)
	}
	if c.scenario == "drain" {
		r.DrainExitCode = victim.Proc.ExitCode()
	}
	r.ObservedFor = c.now().Sub(t0).Seconds()
	if top, err := f.DB.TopStatements(ctx, 6); err == nil {
		r.TopStatements = top
	}

	// Recovery per re-homed node.
	var rec, gaps, detect []time.Duration
	redials := 0
	r.Timeline = map[string][]int{}
	hellos := map[string]map[int]int{} // survivor -> second after t0 -> Welcomes
	for _, n := range sim.Nodes {
		for _, w := range n.Welcomes() {
			if w.At.Before(t0) {
				continue
			}
			if hellos[w.Gateway] == nil {
				hellos[w.Gateway] = map[int]int{}
			}
			hellos[w.Gateway][int(w.At.Sub(t0)/time.Second)]++
			if bin := int(w.At.Sub(t0) / (250 * time.Millisecond)); bin < 40 {
				if r.Timeline[w.Gateway] == nil {
					r.Timeline[w.Gateway] = make([]int, 40)
				}
				r.Timeline[w.Gateway][bin]++
			}
		}
	}
	for _, n := range lost {
		w, ok := n.FirstWelcomeAfter(t0)
		if !ok {
			continue
		}
		if w.Gateway == victim.Name {
			r.BackOnVictim++
		}
		rec = append(rec, w.At.Sub(t0))
		if ends := n.SessionEndsBetween(t0, w.At); len(ends) > 0 {
			detect = append(detect, ends[0].Sub(t0))
			redials += len(ends)
			r.Redials.Max = max(r.Redials.Max, len(ends))
		}
		if end := n.LastSessionEndBefore(w.At); !end.IsZero() && end.After(t0) {
			gaps = append(gaps, w.At.Sub(end))
		}
	}
	r.Rehomed = len(rec)
	r.Recovery = harness.Summarize(rec)
	r.Gap = harness.Summarize(gaps)
	r.Detect = harness.Summarize(detect)
	if len(detect) > 0 {
		r.Redials.Mean = float64(redials) / float64(len(detect))
	}
	if r.AdmissionLimit > 0 {
		r.RecoveryVsLimit = r.Recovery.Max / r.AdmissionLimit
		r.RecoveryVsFloor = r.Recovery.Max / max(r.AdmissionLimit, 1)
		r.GapVsLimit = r.Gap.Max / r.AdmissionLimit
	}
	r.PeakHellosPerSec = map[string]int{}
	for gw, buckets := range hellos {
		for _, v := range buckets {
			r.PeakHellosPerSec[gw] = max(r.PeakHellosPerSec[gw], v)
		}
	}
	r.PushbacksAfterFault = sim.Pushbacks() - pushbacksBefore
	r.PushbacksTotal = sim.Pushbacks()

	// Stop producing; every command created must get its result.
	stopProd()
	prodWG.Wait()
	r.CommandsCreated = created.Load()
	r.CreateErrors = createErrs.Load()
	logf("producer stopped after %d commands; waiting up to %s for results", r.CommandsCreated, c.settle)
	settleStart := c.now()
	open := func() int64 {
		var n int64
		_ = f.DB.Pool.QueryRow(ctx, `SELECT count(*) /*bench*/ FROM commands WHERE state IN ('pending','dispatched','acknowledged')`).Scan(&n)
		return n
	}
	_ = waitFor(ctx, c.settle, func() bool { return open() == 0 })
	r.SettleSeconds = c.now().Sub(settleStart).Seconds()
	stopSmp()
	<-smpDone
	if err := r.collect(ctx, f, sim, smp, victim.Name, pauseDBTime, c); err != nil {
		return nil, err
	}
	r.judge(c)
	return r, nil
}

func waitFor(ctx context.Context, timeout time.Duration, cond func() bool) error {
	return harness.Poll(ctx, timeout, 200*time.Millisecond, cond)
}

// startSiteAgents runs n services/site-agent processes as nodes of one
// site (kind site_agent) through the balancer, on loopback ports only.
// When they do not come up, the demo says so and goes on without them.
func startSiteAgents(ctx context.Context, f *fleet.Fleet, n int, binDir string) {
	bins, err := harness.Binaries(f.Dir, binDir, "site-agent")
	if err != nil {
		logf("note: site agents skipped: %v", err)
		return
	}
	for i := range n {
		id := fmt.Sprintf("site-1-agent-%d", i+1)
		cred, err := nodeauth.NewCredential()
		if err == nil {
			_, err = f.DB.Pool.Exec(ctx, `INSERT INTO nodes (id, kind, site_id) VALUES ($1, 'site_agent', 'site-1')`, id)
		}
		if err == nil {
			_, err = f.DB.Pool.Exec(ctx, `INSERT INTO node_credentials (node_id, credential_hash) VALUES ($1, $2)`, id, nodeauth.Hash(cred))
		}
		if err != nil {
			logf("note: site agents skipped: register %s: %v", id, err)
			return
		}
		// Its cache, TFTP root and journal live in the run's directory, so a
		// fresh machine without /var/lib/leasehold runs the demo too, and the
		// two agents never share a journal (the second would be refused).
		cache, tftpRoot := filepath.Join(f.Dir, id+"-cache"), filepath.Join(f.Dir, id+"-tftp")
		_ = os.MkdirAll(cache, 0o755)
		_ = os.MkdirAll(tftpRoot, 0o755)
		p, err := f.Sup.Start(id, bins["site-agent"], []string{"LEASEHOLD_NODE_CREDENTIAL=" + cred},
			"--gateway-url", f.Address(), "--node-id", id, "--site-id", "site-1", "--http-addr", harness.FreeAddr(),
			"--dhcp.listen-addr", harness.FreeAddr(), "--dhcp.server-ip", "127.0.0.1", "--boot.listen-addr", harness.FreeAddr(),
			"--tftp.root", tftpRoot, "--tftp.listen-addr", harness.FreeAddr(), "--dhcp.pxe-listen-addr", "",
			"--cache.dir", cache, "--journal", filepath.Join(f.Dir, id+"-journal"), "--log-format", "text", "--log-level", "warn")
		if err == nil {
			err = p.WaitReady(ctx, 30*time.Second)
		}
		if err == nil {
			err = waitFor(ctx, 20*time.Second, func() bool {
				var st string
				_ = f.DB.Pool.QueryRow(ctx, `SELECT state /*bench*/ FROM nodes WHERE id = $1`, id).Scan(&st)
				return st == "connected"
			})
			if err != nil {
				err = fmt.Errorf("not connected as a node within 20 s: %w", err)
			}
		}
		if err != nil {
			var last string
			if p != nil {
				last = lastLine(p.Tail())
			}
			logf("note: site agent %s did not come up; going on without site agents: %v (its last log line: %s)", id, firstLine(err.Error()), last)
			if p != nil && !p.Exited() {
				p.Kill()
			}
			return
		}
		logf("site agent %s connected through the balancer as a node of site-1", id)
	}
}

// lastLine is the last non-empty line of s, for an error message.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return lines[len(lines)-1]
}

func firstLine(s string) string {
	first, _, _ := strings.Cut(s, "\n")
	return first
}
