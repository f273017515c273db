package harness

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/leasehold/leasehold/pkg/pglocal"
)

// Backend is one gateway behind the balancer.
type Backend struct {
	Name string
	// Listen is the traffic port, HTTP the /readyz health port.
	Listen, HTTP string
}

// scaledMs is ms milliseconds divided by rate (when above 1), at least 20.
func scaledMs(ms int, rate float64) int {
	if rate > 1 {
		ms = int(float64(ms) / rate)
	}
	return max(ms, 20)
}

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
	var b strings.Builder
	fmt.Fprintf(&b, `global
    maxconn %d
    log stderr format short local0 warning

defaults
    mode tcp
    log global
    timeout connect 2s
    timeout client 1h
    timeout server 1h
    timeout check %dms
    # A refused connect is retried once on another gateway at once.
    retries 1
    option redispatch 1

frontend nodes
    bind %s
    maxconn %d
    # Fail open to live gateways when none is ready (deploy/haproxy).
    use_backend gateways_live if { nbsrv(gateways) eq 0 }
    default_backend gateways

backend gateways
    balance leastconn
    option httpchk GET /readyz
    # A gateway that refuses one connection (killed) is marked down at
    # once instead of after two failed checks: leastconn would otherwise
    # send every new dial to the dead gateway, which has the fewest
    # connections, for up to a second.
    default-server inter %dms fall 2 rise 2 observe layer4 error-limit 1 on-error mark-down
`, maxconn+100, scaledMs(1000, rate), addr, maxconn, scaledMs(500, rate))
	servers := func() {
		for _, be := range backends {
			_, port, _ := strings.Cut(be.HTTP, ":")
			fmt.Fprintf(&b, "    server %s %s check port %s\n", be.Name, be.Listen, port)
		}
	}
	servers()
	fmt.Fprintf(&b, `
backend gateways_live
    balance roundrobin
    option httpchk GET /livez
    default-server inter %dms fall 2 rise 2 observe layer4 error-limit 1 on-error mark-down
`, scaledMs(500, rate))
	servers()
	cfg := filepath.Join(dir, "haproxy.cfg")
	if err := os.WriteFile(cfg, []byte(b.String()), 0o644); err != nil {
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
