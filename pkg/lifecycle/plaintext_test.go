package lifecycle_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/grafana/dskit/services"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/lifecycle"
)

func TestLoopback(t *testing.T) {
	for addr, want := range map[string]bool{
		"127.0.0.1:8080": true, "127.9.9.9:1": true, "[::1]:443": true, "localhost:80": true, "LOCALHOST:80": true,
		"0.0.0.0:8080": false, ":8080": false, "[::]:8080": false, "10.0.0.5:8080": false, "gw.example:443": false, "nonsense": false,
	} {
		require.Equal(t, want, lifecycle.Loopback(addr), addr)
	}
}

func TestCheckPlaintext(t *testing.T) {
	open := lifecycle.Listener{Flag: "listen-addr", Addr: "0.0.0.0:8080", TLSFlag: "api.tls-cert"}
	err := lifecycle.CheckPlaintext([]lifecycle.Listener{open}, false)
	require.ErrorContains(t, err, `--listen-addr "0.0.0.0:8080" is not a loopback address and serves no TLS`)
	require.ErrorContains(t, err, "--api.tls-cert")
	require.ErrorContains(t, err, "--insecure-plaintext")

	require.NoError(t, lifecycle.CheckPlaintext([]lifecycle.Listener{open}, true), "the flag lets it through")
	withTLS := open
	withTLS.TLS = true
	local := open
	local.Addr = "127.0.0.1:8080"
	off := open
	off.Addr = ""
	require.NoError(t, lifecycle.CheckPlaintext([]lifecycle.Listener{withTLS, local, off}, false))

	relay := lifecycle.Listener{Flag: "gateway.relay-listen-addr", Addr: "10.1.2.3:9444", TLSFlag: "gateway.relay-tls.cert-file"}
	err = lifecycle.CheckPlaintext([]lifecycle.Listener{open, relay}, false)
	require.ErrorContains(t, err, "--listen-addr")
	require.ErrorContains(t, err, "--gateway.relay-listen-addr", "every listener at fault is named")
}

// TestRunRefusesPlaintextBeyondLoopback: a program whose listener would
// serve plaintext on a wildcard address exits 2 before building anything,
// naming the flag; --insecure-plaintext (or its environment variable)
// lets it start.
func TestRunRefusesPlaintextBeyondLoopback(t *testing.T) {
	addr := "0.0.0.0:0"
	built := 0
	spec := lifecycle.Spec{
		Name:     "plain",
		HTTPAddr: "127.0.0.1:0",
		Listeners: func() []lifecycle.Listener {
			return []lifecycle.Listener{{Flag: "listen-addr", Addr: addr, TLSFlag: "tls-cert"}}
		},
		Build: func(context.Context, *lifecycle.Process) ([]services.Service, error) {
			built++
			return nil, context.Canceled // stop at once: only the refusal is under test
		},
	}
	logs, err := os.Create(filepath.Join(t.TempDir(), "stderr"))
	require.NoError(t, err)
	defer logs.Close()
	require.Equal(t, 2, lifecycle.Run(context.Background(), spec, nil, logs))
	require.Zero(t, built, "nothing is built for a refused configuration")
	out, err := os.ReadFile(logs.Name())
	require.NoError(t, err)
	require.Contains(t, string(out), `--listen-addr "0.0.0.0:0" is not a loopback address`)

	require.Equal(t, 1, lifecycle.Run(context.Background(), spec, []string{"--insecure-plaintext"}, logs), "let through, then the build's own error")
	require.Equal(t, 1, built)
	t.Setenv("LEASEHOLD_INSECURE_PLAINTEXT", "true")
	require.Equal(t, 1, lifecycle.Run(context.Background(), spec, nil, logs), "the environment fallback works as for every flag")
	require.Equal(t, 2, built)
}
