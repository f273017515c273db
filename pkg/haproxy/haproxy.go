// Package haproxy writes the HAProxy configuration that tests and benches
// put in front of gateways: the same balancing a deployment uses
// (deploy/haproxy), so a test of failover through a balancer exercises the
// real one. TCP mode, leastconn, `option httpchk GET /readyz` against each
// gateway's health port, and failing open to the live gateways (/livez)
// while none is ready.
package haproxy

import (
	"fmt"
	"strings"
)

// Backend is one gateway behind the balancer.
type Backend struct {
	// Name names the server in HAProxy's logs.
	Name string
	// Listen is the gateway's node-stream address, HTTP its health
	// address (/readyz, /livez).
	Listen, HTTP string
}

// Options shape a configuration.
type Options struct {
	// Bind is the address HAProxy listens on for nodes.
	Bind string
	// MaxConn caps the frontend's connections (0: 1,000).
	MaxConn int
	// Rate above 1 shortens the health-check interval and timeout by that
	// factor, for fleets on a scaled clock (their /readyz flips that much
	// faster); never below 20 ms.
	Rate float64
}

// scaledMs is ms divided by rate (when above 1), at least 20.
func scaledMs(ms int, rate float64) int {
	if rate > 1 {
		ms = int(float64(ms) / rate)
	}
	return max(ms, 20)
}

// Config is the configuration text for backends behind o.Bind. Run it in
// the foreground with `haproxy -db -f <file>`.
func Config(backends []Backend, o Options) string {
	if o.MaxConn <= 0 {
		o.MaxConn = 1000
	}
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
`, o.MaxConn+100, scaledMs(1000, o.Rate), o.Bind, o.MaxConn, scaledMs(500, o.Rate))
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
`, scaledMs(500, o.Rate))
	servers()
	return b.String()
}
