// Command leasefailover measures how fast a worker's leases move: a worker
// process (services/worker) holding the shard leases rendezvous hashing
// gives it and every singleton is crashed (SIGKILL), paused (SIGSTOP past
// the TTL) or stopped (SIGTERM), and the time until the surviving worker
// holds every one of those leases is recorded over -runs runs each. The
// same crash and SIGTERM scenarios run, on the same PostgreSQL server,
// against River's leader election (two riverclient processes; time until
// the survivor's leader-only work starts), and the ratio is printed. Last,
// the coordination load of 1, 4, 16 and 64 idle members is read from
// pg_stat_statements.
package main

import (
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/leasehold/leasehold/bench/internal/harness"
)

type config struct {
	runs                   int
	scenarios              []string
	river                  bool
	members                []int
	loadSettle, loadWindow time.Duration
	jsonPath, binDir       string
	durable, keep          bool
	loadLiveness           []bool
}

func main() {
	var c config
	var scenarios, members string
	flag.IntVar(&c.runs, "runs", 20, "runs per scenario")
	var loadLiveness string
	flag.StringVar(&scenarios, "scenarios", "crash,crash-ttl,conn-killed,vanish,pause,sigterm", "leasehold scenarios: crash (SIGKILL, liveness session), crash-ttl (SIGKILL, liveness off), conn-killed (every session of a live process terminated until the takeover), vanish (the process's host vanishes: its network namespace's link is cut, no FIN/RST; needs root, skipped otherwise), pause, sigterm (River runs crash and sigterm)")
	flag.StringVar(&loadLiveness, "load-liveness", "on", "coordination load: with liveness sessions on, off, or on,off (side by side)")
	flag.BoolVar(&c.river, "river", true, "run River's leader election side by side")
	flag.StringVar(&members, "members", "1,4,16,64", "coordination load: member counts (empty: skip)")
	flag.DurationVar(&c.loadSettle, "load-settle", 15*time.Second, "coordination load: wait after the members are ready")
	flag.DurationVar(&c.loadWindow, "load-window", 20*time.Second, "coordination load: measuring window")
	flag.StringVar(&c.jsonPath, "json", "", "write the result as JSON to this file")
	flag.StringVar(&c.binDir, "bin", "", "use a prebuilt leasehold-worker from this directory (default: build)")
	flag.BoolVar(&c.durable, "durable", true, "local PostgreSQL with fsync and synchronous_commit on")
	flag.BoolVar(&c.keep, "keep", false, "keep the work directory with every process's log")
	flag.Parse()
	for _, s := range strings.Split(scenarios, ",") {
		switch s = strings.TrimSpace(s); s {
		case "crash", "crash-ttl", "conn-killed", "vanish", "pause", "sigterm":
			c.scenarios = append(c.scenarios, s)
		case "":
		default:
			fmt.Fprintf(os.Stderr, "leasefailover: unknown scenario %q\n", s)
			os.Exit(2)
		}
	}
	for _, m := range strings.Split(members, ",") {
		if m = strings.TrimSpace(m); m == "" {
			continue
		}
		n, err := strconv.Atoi(m)
		if err != nil || n < 1 || n > 200 {
			fmt.Fprintf(os.Stderr, "leasefailover: bad member count %q\n", m)
			os.Exit(2)
		}
		c.members = append(c.members, n)
	}
	for _, v := range strings.Split(loadLiveness, ",") {
		switch strings.TrimSpace(v) {
		case "on":
			c.loadLiveness = append(c.loadLiveness, true)
		case "off":
			c.loadLiveness = append(c.loadLiveness, false)
		case "":
		default:
			fmt.Fprintf(os.Stderr, "leasefailover: -load-liveness %q: want on, off or on,off\n", v)
			os.Exit(2)
		}
	}
	if c.runs < 1 {
		fmt.Fprintln(os.Stderr, "leasefailover: -runs must be >= 1")
		os.Exit(2)
	}
	b := &bench{c: c, sup: &harness.Supervisor{}}
	ctx, cancel := harness.SignalContext(b.sup.Stop)
	defer cancel()
	res, err := b.run(ctx)
	if err != nil {
		fmt.Fprintln(os.Stderr, "leasefailover:", err)
		os.Exit(2)
	}
	res.print(os.Stdout)
	if err := harness.WriteJSON(c.jsonPath, res); err != nil {
		fmt.Fprintln(os.Stderr, "leasefailover: write json:", err)
		os.Exit(2) // -json was asked for and not written
	}
	if !res.Gate.Pass {
		os.Exit(1)
	}
}
