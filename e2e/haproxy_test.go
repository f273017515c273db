package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/fleettest"
	"github.com/leasehold/leasehold/pkg/haproxy"
	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/pkg/proctest"
)

// nodeBalancer puts a balancer in front of gws and returns the address
// nodes dial: HAProxy with the deployment's balancing (pkg/haproxy) when
// it is installed, as in CI, else the in-process faultproxy balancer with
// a log line saying so.
func nodeBalancer(t *testing.T, gws ...fleettest.Gateway) string {
	t.Helper()
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		t.Log("haproxy not installed: the nodes dial an in-process balancer instead")
		listens := make([]string, len(gws))
		for i, g := range gws {
			listens[i] = g.Listen
		}
		return balancer(t, listens...).Addr()
	}
	backends := make([]haproxy.Backend, len(gws))
	for i, g := range gws {
		backends[i] = haproxy.Backend{Name: g.Name, Listen: g.Listen, HTTP: g.HTTPAddr}
	}
	addr := fleettest.Addr(t)
	cfg := filepath.Join(t.TempDir(), "haproxy.cfg")
	require.NoError(t, os.WriteFile(cfg, []byte(haproxy.Config(backends, haproxy.Options{Bind: addr})), 0o600))
	p := proctest.Start(t, "haproxy", bin, nil, "-db", "-f", cfg)
	if err := pglocal.WaitTCP(addr, 10*time.Second); err != nil {
		t.Fatalf("haproxy: %v\n%s", err, p.Logs())
	}
	return addr
}
