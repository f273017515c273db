// Command nodesim runs simulated leasehold nodes (bench/internal/fleet.Sim)
// in a process of their own, so that a bench's creators and its nodes do
// not share one Go scheduler, as River's worker (cmd/riverclient) has a
// process of its own. It reads one "id credential" line per node from
// -nodes, dials -address, prints "CONNECTED <n>" whenever the number of
// nodes with an open session changes, and runs until SIGTERM. It raises its
// RLIMIT_NOFILE first (-nofile): every node holds a connection.
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/leasehold/leasehold/bench/internal/fleet"
	"github.com/leasehold/leasehold/bench/internal/harness"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

func main() {
	address := flag.String("address", "", "gateway (or load balancer) URL, e.g. http://127.0.0.1:9443")
	nodesPath := flag.String("nodes", "", `file with one "id credential" line per node`)
	rate := flag.Int("hello-rate", 200, "nodes started per second")
	nofile := flag.Uint64("nofile", 65536, "raise RLIMIT_NOFILE to this (one descriptor per node)")
	flag.Parse()
	if *address == "" || *nodesPath == "" {
		fmt.Fprintln(os.Stderr, "nodesim: -address and -nodes are required")
		os.Exit(2)
	}
	if n, err := harness.RaiseNoFile(*nofile); err != nil {
		fmt.Fprintln(os.Stderr, "nodesim: raise RLIMIT_NOFILE:", err)
	} else if n < *nofile {
		fmt.Fprintf(os.Stderr, "nodesim: RLIMIT_NOFILE is %d, not %d\n", n, *nofile)
	}
	if err := run(*address, *nodesPath, *rate); err != nil {
		fmt.Fprintln(os.Stderr, "nodesim:", err)
		os.Exit(1)
	}
}

func run(address, nodesPath string, rate int) error {
	f, err := os.Open(nodesPath)
	if err != nil {
		return err
	}
	defer f.Close()
	sim := &fleet.Sim{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		id, cred, ok := strings.Cut(strings.TrimSpace(sc.Text()), " ")
		if !ok {
			continue
		}
		if _, err := sim.Add(address, id, cred, nodev1.NodeKind_NODE_KIND_NODE); err != nil {
			return fmt.Errorf("node %s: %w", id, err)
		}
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("read %s: %w", nodesPath, err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	go sim.Start(ctx, rate)
	last := -1
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			sim.Wait()
			return nil
		case <-t.C:
			if n := sim.Connected(); n != last {
				fmt.Printf("CONNECTED %d\n", n)
				last = n
			}
		}
	}
}
