package harness

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/leasehold/leasehold/pkg/haproxy"
	"github.com/leasehold/leasehold/pkg/pglocal"
)

// Backend is one gateway behind the balancer.
type Backend = haproxy.Backend

// fdsPerProcess is how many descriptors one HAProxy process may use for
// proxied connections (two per connection). It stays under the common hard
// RLIMIT_NOFILE of 20,000 so a 10,000-node fleet needs no raised limit.
const fdsPerProcess = 18000

// StartHAProxy runs HAProxy (TCP mode, leastconn, `option httpchk GET
// /readyz` against each backend's health port, failing open to the live
// ones on /livez while none is ready) in the foreground as
// children and returns the address they listen on. HAProxy needs two
// descriptors per proxied connection, so when maxconn needs more than
// fdsPerProcess it starts several identical processes bound to the same
// address with SO_REUSEPORT (HAProxy's default on Linux): the kernel spreads
// new connections across them, each balancing over every gateway.
//
// rate > 1 shortens the health-check interval and timeout by that factor,
// for fleets on a scaled clock (their /readyz flips rate times faster).
func StartHAProxy(ctx context.Context, sup *Supervisor, dir string, backends []Backend, maxconn int, rate float64) (string, []*Proc, error) {
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		return "", nil, fmt.Errorf("haproxy not found: install it with `apt-get install -y haproxy`: %w", err)
	}
	procs := (2*maxconn + fdsPerProcess - 1) / fdsPerProcess
	maxconn = (maxconn + procs - 1) / procs
	addr := FreeAddr()
	text := haproxy.Config(backends, haproxy.Options{Bind: addr, MaxConn: maxconn, Rate: rate})
	cfg := filepath.Join(dir, "haproxy.cfg")
	if err := os.WriteFile(cfg, []byte(text), 0o644); err != nil {
		return "", nil, err
	}
	var ps []*Proc
	for i := range procs {
		name := "haproxy"
		if procs > 1 {
			name = fmt.Sprintf("haproxy-%d", i+1)
		}
		p, err := sup.Start(name, bin, nil, "-db", "-f", cfg)
		if err != nil {
			return "", ps, err
		}
		ps = append(ps, p)
		if err := pglocal.WaitTCP(addr, 10*time.Second); err != nil {
			return "", ps, fmt.Errorf("%s: %w\n%s", name, err, p.Tail())
		}
	}
	// Later processes share an address the first already answers on: give
	// them a moment to fail (bind refused, fd limit) before trusting them.
	select {
	case <-ctx.Done():
		return "", ps, ctx.Err()
	case <-time.After(300 * time.Millisecond):
	}
	for _, p := range ps {
		if p.Exited() {
			return "", ps, fmt.Errorf("%s exited at start:\n%s", p.Name, p.Tail())
		}
	}
	return addr, ps, nil
}
