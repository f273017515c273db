package haproxy_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/haproxy"
	"github.com/leasehold/leasehold/pkg/leakcheck"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }

// TestConfigIsValid: HAProxy itself accepts the configuration (`haproxy
// -c`), with every gateway in both backends and the health checks scaled
// by the rate.
func TestConfigIsValid(t *testing.T) {
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		t.Skip("haproxy not installed")
	}
	cfg := haproxy.Config([]haproxy.Backend{
		{Name: "gw_a", Listen: "127.0.0.1:7001", HTTP: "127.0.0.1:7101"},
		{Name: "gw_b", Listen: "127.0.0.1:7002", HTTP: "127.0.0.1:7102"},
	}, haproxy.Options{Bind: "127.0.0.1:7000", Rate: 10})
	require.Equal(t, 2, strings.Count(cfg, "server gw_a 127.0.0.1:7001 check port 7101"), cfg)
	require.Contains(t, cfg, "inter 50ms", "a rate of 10 checks ten times as often")
	path := filepath.Join(t.TempDir(), "haproxy.cfg")
	require.NoError(t, os.WriteFile(path, []byte(cfg), 0o600))
	out, err := exec.Command(bin, "-c", "-f", path).CombinedOutput()
	require.NoError(t, err, "%s", out)
}
