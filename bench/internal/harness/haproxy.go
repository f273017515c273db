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

// StartHAProxy runs HAProxy (TCP mode, leastconn, `option httpchk GET
// /readyz` against each backend's health port) in the foreground as a child
// and returns the address it listens on.
func StartHAProxy(ctx context.Context, sup *Supervisor, dir string, backends []Backend, maxconn int) (string, *Proc, error) {
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		return "", nil, fmt.Errorf("haproxy not found: install it with `apt-get install -y haproxy`: %w", err)
	}
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
    timeout check 1s
    retries 3
    option redispatch

frontend nodes
    bind %s
    maxconn %d
    default_backend gateways

backend gateways
    balance leastconn
    option httpchk GET /readyz
    default-server inter 500ms fall 2 rise 2
`, maxconn+100, addr, maxconn)
	for _, be := range backends {
		_, port, _ := strings.Cut(be.HTTP, ":")
		fmt.Fprintf(&b, "    server %s %s check port %s\n", be.Name, be.Listen, port)
	}
	cfg := filepath.Join(dir, "haproxy.cfg")
	if err := os.WriteFile(cfg, []byte(b.String()), 0o644); err != nil {
		return "", nil, err
	}
	p, err := sup.Start("haproxy", bin, nil, "-db", "-f", cfg)
	if err != nil {
		return "", nil, err
	}
	if err := pglocal.WaitTCP(addr, 10*time.Second); err != nil {
		return "", nil, fmt.Errorf("haproxy: %w\n%s", err, p.Tail())
	}
	return addr, p, nil
}
