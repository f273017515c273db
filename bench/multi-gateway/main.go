// Command multi-gateway is the fleet simulator and failover gate: three real
// gateways behind HAProxy, the real worker, scheduler and api, real
// PostgreSQL, and N simulated node daemons (pkg/daemon, one TCP connection
// each) with commands flowing to random nodes throughout. It injures one
// gateway (kill: SIGKILL, zombie: SIGSTOP then SIGCONT, drain: SIGTERM),
// measures how the fleet re-homes, prints a table, writes JSON and exits 1
// when the gate fails.
package main

import (
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/leasehold/leasehold/bench/internal/fleet"
	"github.com/leasehold/leasehold/bench/internal/harness"
	"github.com/leasehold/leasehold/pkg/clock"
)

func main() {
	var c config
	flag.StringVar(&c.scenario, "scenario", "kill", "kill (SIGKILL), zombie (SIGSTOP -pause, then SIGCONT) or drain (SIGTERM)")
	flag.IntVar(&c.nodes, "nodes", 1000, "simulated nodes (1000, 3000, 10000)")
	flag.IntVar(&c.gateways, "gateways", 3, "gateway processes")
	flag.Float64Var(&c.rate, "rate", 50, "commands created per second, to random nodes")
	flag.StringVar(&c.producer, "producer", "api", "api (ControlService.CreateCommand) or sql (INSERT INTO commands)")
	flag.DurationVar(&c.warmup, "warmup", 15*time.Second, "steady state before the fault")
	flag.DurationVar(&c.observe, "observe", 60*time.Second, "minimum observation after the fault")
	flag.DurationVar(&c.maxWait, "max-wait", 3*time.Minute, "give up waiting for re-homing after this long")
	flag.DurationVar(&c.settle, "settle", 90*time.Second, "after the producer stops, wait this long at most for every command's result")
	flag.DurationVar(&c.pause, "pause", 30*time.Second, "zombie: how long the gateway stays SIGSTOPped")
	flag.DurationVar(&c.drainDelay, "drain-max-delay", 60*time.Second, "gateways' --gateway.drain-max-delay")
	flag.DurationVar(&c.lossGrace, "loss-grace", 10*time.Second, "worker's --nodes.gateway-loss-grace (default 120 s in production; shorter so a false unreachable mark would show within the run)")
	flag.Float64Var(&c.helloRate, "hello-rate", 200, "gateways' --gateway.hello-rate (admission bucket)")
	flag.IntVar(&c.streams, "max-streams", 0, "gateways' --gateway.max-streams (0: the default 5000, or what the survivors of one lost gateway need with 10% headroom when that is more)")
	flag.StringVar(&c.timings, "timings", "real", "real (production durations) or fast (gateway lease 2 s, session lease 6 s, shard TTL 3 s)")
	flag.Float64Var(&c.scale.Rate, "clock-rate", 1, "run services, database and daemons on a clock this many times faster than wall time (pkg/clock; 1 = real time); reported durations are then simulated seconds")
	flag.StringVar(&c.jsonPath, "json", "", "write the result as JSON to this file")
	flag.StringVar(&c.binDir, "bin", "", "use prebuilt leasehold-<service> binaries from this directory (default: build)")
	flag.BoolVar(&c.durable, "durable", true, "local PostgreSQL with fsync and synchronous_commit on")
	flag.BoolVar(&c.progress, "progress", false, "redraw a live progress line (for a terminal) instead of a line every 5 s")
	flag.IntVar(&c.siteAgents, "site-agents", 0, "site agents to run as nodes (demo), when services/site-agent supports it")
	flag.BoolVar(&c.keep, "keep", false, "keep the work directory with every process's log")
	flag.Parse()
	if c.scale.Rate > 1 {
		c.scale.Epoch = time.Now() // every process and the database share it
	}
	if err := c.validate(); err != nil {
		fmt.Fprintln(os.Stderr, "multi-gateway:", err)
		os.Exit(2)
	}
	var f *fleet.Fleet
	ctx, cancel := harness.SignalContext(func() {
		if f != nil {
			f.Sup.Stop()
		}
	})
	defer cancel()
	res, err := run(ctx, c, func(fl *fleet.Fleet) { f = fl })
	if err != nil {
		fmt.Fprintln(os.Stderr, "multi-gateway:", err)
		os.Exit(2)
	}
	res.print(os.Stdout)
	if err := harness.WriteJSON(c.jsonPath, res); err != nil {
		fmt.Fprintln(os.Stderr, "multi-gateway: write json:", err)
		os.Exit(2) // -json was asked for and not written
	}
	if !res.Gate.Pass {
		os.Exit(1)
	}
}

type config struct {
	scenario, producer, timings, jsonPath, binDir string
	nodes, gateways, siteAgents, streams          int
	rate, helloRate                               float64
	warmup, observe, maxWait, settle, pause       time.Duration
	drainDelay, lossGrace                         time.Duration
	durable, progress, keep                       bool
	scale                                         clock.Scale
}

// now is the bench's clock: simulated time in a scaled run.
func (c config) now() time.Time {
	if c.scale.Rate > 1 {
		return c.scale.Sim(time.Now())
	}
	return time.Now()
}

// wall is how long simulated duration d takes on the wall clock.
func (c config) wall(d time.Duration) time.Duration {
	if c.scale.Rate > 1 {
		return time.Duration(float64(d) / c.scale.Rate)
	}
	return d
}

func (c config) validate() error {
	switch c.scenario {
	case "kill", "zombie", "drain":
	default:
		return fmt.Errorf("-scenario %q: want kill, zombie or drain", c.scenario)
	}
	if c.timings != "real" && c.timings != "fast" {
		return fmt.Errorf("-timings %q: want real or fast", c.timings)
	}
	if c.producer != "api" && c.producer != "sql" {
		return fmt.Errorf("-producer %q: want api or sql", c.producer)
	}
	if c.nodes < 1 || c.gateways < 2 {
		return fmt.Errorf("-nodes %d must be >= 1 and -gateways %d >= 2", c.nodes, c.gateways)
	}
	if c.scale.Rate != 0 && c.scale.Rate != 1 {
		s := clock.Scale{Epoch: time.Now(), Rate: c.scale.Rate}
		if err := s.Validate(); err != nil {
			return fmt.Errorf("-clock-rate: %w", err)
		}
	}
	if c.scale.Rate > 1 && c.siteAgents > 0 {
		return fmt.Errorf("-clock-rate %g with -site-agents %d: the site agent has no scaled clock", c.scale.Rate, c.siteAgents)
	}
	if c.streams < 0 {
		return fmt.Errorf("-max-streams %d must be >= 0", c.streams)
	}
	return nil
}

// maxStreams is the gateways' --gateway.max-streams: as given, else the
// default 5,000 unless the survivors of one lost gateway need more (the
// fleet, spread over gateways-1, plus 10%: an operator sizes it the same).
func (c config) maxStreams() int {
	if c.streams > 0 {
		return c.streams
	}
	need := c.nodes*11/10/(c.gateways-1) + 1
	return max(5000, need)
}
