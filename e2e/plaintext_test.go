package e2e

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/fleettest"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/tlstest"
)

// TestPlaintextBeyondLoopbackRefused: every service whose listener carries
// credentials or commands refuses to start (exit 2, nothing served) when
// it would serve plaintext on an address other than loopback, naming the
// listener's flag, its TLS flag and --insecure-plaintext (pkg/lifecycle's
// tests show TLS, loopback and the flag letting a listener through).
func TestPlaintextBeyondLoopbackRefused(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ca := tlstest.NewCA(t)
	cert, key := tlstest.WriteKeyPair(t, ca.Server(t))
	tokenFile := filepath.Join(t.TempDir(), "relay-token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(tunnelRelayToken), 0o600))
	common := []string{"--database-url", db.URL, "--http-addr", "127.0.0.1:0"}

	for _, c := range []struct {
		service string
		args    []string
		want    []string
	}{
		{"api", []string{"--listen-addr", "0.0.0.0:0"}, []string{`--listen-addr "0.0.0.0:0" is not a loopback address`, "--api.tls-cert"}},
		{"gateway", []string{"--listen-addr", ":0"}, []string{`--listen-addr ":0" is not a loopback address`, "--tls-cert"}},
		{"gateway", []string{"--listen-addr", "127.0.0.1:0", "--tls-cert", cert, "--tls-key", key,
			"--gateway.relay-listen-addr", "0.0.0.0:0", "--gateway.relay-token-file", tokenFile},
			[]string{`--gateway.relay-listen-addr "0.0.0.0:0" is not a loopback address`, "--gateway.relay-tls.cert-file"}},
		{"doctor", []string{"serve", "--listen-addr", "[::]:0"}, []string{`--listen-addr "[::]:0" is not a loopback address`, "--tls-cert"}},
	} {
		bin := fleettest.Binary(t, c.service)
		args := c.args
		if c.service == "doctor" {
			args = append(args[:1:1], append(append([]string{}, common...), args[1:]...)...)
		} else {
			args = append(append([]string{}, common...), args...)
		}
		out, err := exec.Command(bin, args...).CombinedOutput()
		var exit *exec.ExitError
		require.True(t, errors.As(err, &exit), "%s %v: %v\n%s", c.service, args, err, out)
		require.Equal(t, 2, exit.ExitCode(), "%s %v: a refused configuration exits 2\n%s", c.service, args, out)
		for _, w := range append(c.want, "--insecure-plaintext") {
			require.Contains(t, string(out), w, "%s %v", c.service, args)
		}
		require.NotContains(t, strings.ToLower(string(out)), "listening", "nothing was served")
	}
}
