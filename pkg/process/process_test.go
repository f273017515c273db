package process_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/buildinfo"
	"github.com/leasehold/leasehold/pkg/lifecycle"
	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/process"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

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

func TestRunMigratesServesHealthAndStops(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmpty(t)
	port, err := pglocal.FreePort()
	require.NoError(t, err)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	logs, err := os.CreateTemp(t.TempDir(), "log")
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	built := make(chan *process.Process, 1)
	spec := process.Spec{
		Name: "testsvc", HTTPAddr: "127.0.0.1:0",
		Build: func(ctx context.Context, p *process.Process) ([]services.Service, error) {
			built <- p
			return []services.Service{services.NewIdleService(nil, nil)}, nil
		},
	}
	exit := make(chan int, 1)
	go func() {
		exit <- process.Run(ctx, spec, []string{"--database-url", db.URL, "--migrate", "--http-addr", addr, "--health-token", "s3cret"}, logs)
	}()
	p := <-built
	require.True(t, strings.HasPrefix(p.Config.ID, "testsvc-"))
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://" + addr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 10*time.Second, 20*time.Millisecond)

	code, _ := get(t, "http://"+addr+"/livez", "")
	require.Equal(t, http.StatusOK, code)
	code, body := get(t, "http://"+addr+"/metrics", "")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "go_goroutines")
	require.Contains(t, body, lifecycle.BuildInfoMetric+`{goversion="`+buildinfo.Get().GoVersion+`",revision="`+buildinfo.Get().Revision+`",version="`+buildinfo.Version()+`"} 1`)
	code, _ = get(t, "http://"+addr+"/healthz/detail", "")
	require.Equal(t, http.StatusUnauthorized, code)
	code, _ = get(t, "http://"+addr+"/healthz/detail", "wrong")
	require.Equal(t, http.StatusUnauthorized, code)
	code, body = get(t, "http://"+addr+"/healthz/detail", "s3cret")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `"ready": true`)
	require.Contains(t, body, `"version": "`+buildinfo.Version()+`"`)

	// --migrate applied every migration.
	var n int
	require.NoError(t, db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM leases").Scan(&n))

	cancel()
	select {
	case code := <-exit:
		require.Equal(t, 0, code)
	case <-time.After(15 * time.Second):
		t.Fatal("did not stop")
	}
}

func TestRunRefusesBadConfiguration(t *testing.T) {
	t.Parallel()
	logs, err := os.CreateTemp(t.TempDir(), "log")
	require.NoError(t, err)
	spec := process.Spec{Name: "testsvc", HTTPAddr: "127.0.0.1:0",
		Build: func(context.Context, *process.Process) ([]services.Service, error) { return nil, nil }}
	code := process.Run(context.Background(), spec, []string{"--log-level", "loud", "--id", "has space"}, logs)
	require.Equal(t, 2, code)
	out, err := os.ReadFile(logs.Name())
	require.NoError(t, err)
	require.Contains(t, string(out), "--database-url (LEASEHOLD_DATABASE_URL) is required")
	require.Contains(t, string(out), `--log-level "loud"`)
	require.Contains(t, string(out), "--id")
}

// TestRunVersionNeedsNothing: --version prints and exits 0 before any
// configuration is checked (no database URL), and LEASEHOLD_VERSION in the
// environment never turns a service into a version printer.
func TestRunVersionNeedsNothing(t *testing.T) {
	logs, err := os.CreateTemp(t.TempDir(), "log")
	require.NoError(t, err)
	spec := process.Spec{Name: "testsvc", HTTPAddr: "127.0.0.1:0",
		Build: func(context.Context, *process.Process) ([]services.Service, error) { return nil, nil }}
	require.Equal(t, 0, process.Run(context.Background(), spec, []string{"--version"}, logs))
	t.Setenv("LEASEHOLD_VERSION", "true")
	require.Equal(t, 2, process.Run(context.Background(), spec, nil, logs), "no database URL: the env var did not print a version")
}

func TestRunRefusesDatabaseNewerThanBinary(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	_, err := db.Pool.Exec(context.Background(), "INSERT INTO goose_db_version (version_id, is_applied) VALUES (99999, true)")
	require.NoError(t, err)
	logs, err := os.CreateTemp(t.TempDir(), "log")
	require.NoError(t, err)
	spec := process.Spec{Name: "testsvc", HTTPAddr: "127.0.0.1:0",
		Build: func(context.Context, *process.Process) ([]services.Service, error) { return nil, nil }}
	code := process.Run(context.Background(), spec, []string{"--database-url", db.URL, "--migrate"}, logs)
	require.Equal(t, 1, code)
	out, _ := os.ReadFile(logs.Name())
	require.Contains(t, string(out), "database schema is newer than this binary")
}

func TestEnvFallback(t *testing.T) {
	t.Setenv("LEASEHOLD_LOG_LEVEL", "debug")
	require.Equal(t, "LEASEHOLD_DATABASE_URL", lifecycle.EnvName("database-url"))
	var cfg process.Config
	fs := newFlagSet(&cfg)
	require.NoError(t, fs.Parse([]string{"--log-format", "text"}))
	require.NoError(t, lifecycle.ApplyEnv(fs))
	require.Equal(t, "debug", cfg.LogLevel)
	require.Equal(t, "text", cfg.LogFormat)
}
