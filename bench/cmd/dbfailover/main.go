// Command dbfailover measures how leasehold rides through PostgreSQL's own
// faults. Each scenario starts a primary and a streaming standby (pkg/pgha),
// a whole control plane on the multi-host URL with
// target_session_attrs=read-write (two gateways behind HAProxy, two workers,
// a scheduler, the api) and simulated node daemons, creates commands through
// the api at a steady rate, and then:
//
//	outage         stops PostgreSQL (fast shutdown) for -outage (45 s), starts it
//	restart        a fast restart (stop, start at once)
//	promote-sync   SIGKILLs the primary under load and promotes the synchronous standby
//	promote-async  the same with asynchronous replication, the standby's WAL
//	               receiver stopped for the last -async-lag (2 s) before the kill
//
// It reports per scenario: the time from the database being back (started
// or promoted) to every lease held before the fault being held again and
// renewed or taken since (read from the leases table and a trigger-written
// log of grants), commands acknowledged by the api vs completed
// (lost = acknowledged, never completed), duplicates (a command executed
// twice on a node, from the daemons' execution log), processes that exited
// (none is restarted: a process that exits stays down and counts), and
// whether two holders overlapped: one lease at one epoch seen with two
// owners (polled from outside, so grants lost with the old primary count
// too), or a grant to a new owner logged (by a trigger on leases) while the
// previous owner's grant was still valid.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/bench/internal/fleet"
	"github.com/leasehold/leasehold/bench/internal/harness"
)

type config struct {
	scenarios      []string
	outage         time.Duration
	nodes          int
	rate           float64
	warmup, after  time.Duration
	recoverTimeout time.Duration
	asyncLag       time.Duration
	timings        fleet.Timings
	jsonPath       string
	binDir         string
	keep, progress bool
}

var allScenarios = []string{"outage", "restart", "promote-sync", "promote-async"}

func main() {
	var c config
	var scenarios, timings string
	flag.StringVar(&scenarios, "scenario", "all", "outage, restart, promote-sync, promote-async (comma-separated) or all")
	flag.DurationVar(&c.outage, "outage", 45*time.Second, "outage: how long PostgreSQL stays stopped")
	flag.IntVar(&c.nodes, "nodes", 50, "simulated node daemons")
	flag.Float64Var(&c.rate, "rate", 20, "commands created per second through the api")
	flag.DurationVar(&c.warmup, "warmup", 10*time.Second, "load before the fault")
	flag.DurationVar(&c.after, "after", 10*time.Second, "load after every lease is held again")
	flag.DurationVar(&c.asyncLag, "async-lag", 2*time.Second, "promote-async: the standby receives nothing for this long before the primary is killed (replication lag; 0: none)")
	flag.DurationVar(&c.recoverTimeout, "recover-timeout", 5*time.Minute, "give up waiting for recovery after this long")
	flag.StringVar(&timings, "timings", "real", "service timings: real (production defaults) or fast (about tenfold shorter)")
	flag.StringVar(&c.jsonPath, "json", "", "write the result as JSON to this file")
	flag.StringVar(&c.binDir, "bin", "", "use prebuilt leasehold-* binaries from this directory (default: build)")
	flag.BoolVar(&c.keep, "keep", false, "keep each scenario's work directory with every process's log")
	flag.BoolVar(&c.progress, "progress", true, "log progress to stderr")
	flag.Parse()
	if scenarios == "all" {
		c.scenarios = allScenarios
	} else {
		for _, s := range strings.Split(scenarios, ",") {
			s = strings.TrimSpace(s)
			switch s {
			case "outage", "restart", "promote-sync", "promote-async":
				c.scenarios = append(c.scenarios, s)
			case "":
			default:
				fmt.Fprintf(os.Stderr, "dbfailover: -scenario %q: want outage, restart, promote-sync, promote-async or all\n", s)
				os.Exit(2)
			}
		}
	}
	switch c.timings = fleet.Timings(timings); c.timings {
	case fleet.Real, fleet.Fast:
	default:
		fmt.Fprintf(os.Stderr, "dbfailover: -timings %q: want real or fast\n", timings)
		os.Exit(2)
	}
	if c.nodes < 1 || c.rate <= 0 || c.outage <= 0 {
		fmt.Fprintln(os.Stderr, "dbfailover: -nodes, -rate and -outage must be positive")
		os.Exit(2)
	}
	// stopAll is set by each scenario as it starts and read by the signal
	// handler, from another goroutine.
	var stopAll atomic.Pointer[func()]
	ctx, cancel := harness.SignalContext(func() {
		if kill := stopAll.Load(); kill != nil {
			(*kill)()
		}
	})
	defer cancel()
	res, err := runAll(ctx, c, func(kill func()) { stopAll.Store(&kill) })
	if err != nil {
		os.Exit(2)
	}
	res.print(os.Stdout)
	if err := harness.WriteJSON(c.jsonPath, res); err != nil {
		fmt.Fprintln(os.Stderr, "dbfailover: write json:", err)
		os.Exit(2)
	}
	if !res.Gate.Pass {
		os.Exit(1)
	}
}

// runAll runs c's scenarios one after another and judges them. Before each
// it hands that scenario's kill to killer (a second Ctrl-C stops what the
// scenario started). A scenario that fails before it has a result ends the
// bench with that error (already printed); one that fails later records the
// error in its result and the next one runs.
func runAll(ctx context.Context, c config, killer func(kill func())) (*result, error) {
	res := &result{Machine: harness.Host(), Date: time.Now().UTC().Format(time.RFC3339), Timings: string(c.timings),
		Nodes: c.nodes, Rate: c.rate, Outage: c.outage.Seconds(), AsyncLag: c.asyncLag.Seconds()}
	for _, s := range c.scenarios {
		r := &run{c: c, scenario: s}
		killer(r.kill)
		sr, err := r.do(ctx)
		if err != nil {
			fmt.Fprintf(os.Stderr, "dbfailover: %s: %v\n", s, err)
			if sr == nil {
				return nil, fmt.Errorf("%s: %w", s, err)
			}
			sr.Error = err.Error()
		}
		res.Scenarios = append(res.Scenarios, sr)
		if ctx.Err() != nil {
			break
		}
	}
	res.judge()
	return res, nil
}
