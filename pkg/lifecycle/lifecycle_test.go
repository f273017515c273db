package lifecycle_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"testing"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/lifecycle"
	"github.com/leasehold/leasehold/pkg/pglocal"
)

func get(t *testing.T, url, token string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestRunWithoutDatabase: a program starts with no database flag at all, is
// ready without a database check, takes its id and log attributes from
// Identity, has no database flags, and stops cleanly.
func TestRunWithoutDatabase(t *testing.T) {
	t.Parallel()
	port, err := pglocal.FreePort()
	require.NoError(t, err)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	logs, err := os.CreateTemp(t.TempDir(), "log")
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	built := make(chan *lifecycle.Process, 1)
	spec := lifecycle.Spec{
		Name: "nodb", HTTPAddr: "127.0.0.1:0", ShutdownTimeout: 7 * time.Second,
		Identity: func() (string, []any) { return "node-7", []any{"site", "site-3"} },
		Build: func(ctx context.Context, p *lifecycle.Process) ([]services.Service, error) {
			built <- p
			return []services.Service{services.NewIdleService(nil, nil)}, nil
		},
	}
	exit := make(chan int, 1)
	go func() {
		exit <- lifecycle.Run(ctx, spec, []string{"--http-addr", addr, "--health-token", "s3cret"}, logs)
	}()
	var p *lifecycle.Process
	select {
	case p = <-built:
	case code := <-exit:
		out, _ := os.ReadFile(logs.Name())
		t.Fatalf("exited %d before building:\n%s", code, out)
	}
	require.NotNil(t, p.Clock)
	require.Equal(t, "node-7", p.Config.ID, "the id comes from Identity")
	require.Equal(t, 7*time.Second, p.Config.ShutdownTimeout, "Spec.ShutdownTimeout is the flag's default")
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://" + addr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 10*time.Second, 20*time.Millisecond)
	code, body := get(t, "http://"+addr+"/healthz/detail", "s3cret")
	require.Equal(t, http.StatusOK, code)
	require.NotContains(t, body, `"database"`, "no database readiness check")
	code, body = get(t, "http://"+addr+"/metrics", "")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "go_goroutines")

	cancel()
	select {
	case code := <-exit:
		require.Equal(t, 0, code)
	case <-time.After(15 * time.Second):
		t.Fatal("did not stop")
	}
	out, err := os.ReadFile(logs.Name())
	require.NoError(t, err)
	require.Contains(t, string(out), `"id":"node-7","site":"site-3"`)
	require.Contains(t, string(out), "stopped cleanly")

	// The database flags do not exist: asking for one is a usage error.
	for _, flag := range []string{"--database-url", "--migrate", "--id", "--clock.rate"} {
		require.Equal(t, 2, lifecycle.Run(context.Background(), spec, []string{flag, "x"}, logs), flag)
	}
	// Nor does --insecure-plaintext: the program has no listener it would
	// concern (Spec.Listeners).
	require.Equal(t, 2, lifecycle.Run(context.Background(), spec, []string{"--insecure-plaintext"}, logs))
}
