package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestEveryServiceStartsServesHealthAndStopsOnSIGTERM runs each service
// binary that connects to the database as a real process against a real
// database. (The site agent is a node, not a database client: its own tests
// run it against a gateway.)
func TestEveryServiceStartsServesHealthAndStopsOnSIGTERM(t *testing.T) {
	db := pgtest.NewEmpty(t)
	for i, name := range []string{"worker", "scheduler", "gateway", "api", "doctor"} {
		t.Run(name, func(t *testing.T) {
			bin := proctest.Build(t, "../../services/"+name)
			port, err := pglocal.FreePort()
			require.NoError(t, err)
			args := []string{"--http-addr", fmt.Sprintf("127.0.0.1:%d", port), "--health-token", "tok"}
			if i == 0 {
				args = append(args, "--migrate") // the first one migrates the empty database
			}
			if name == "gateway" || name == "api" {
				listen, err := pglocal.FreePort()
				require.NoError(t, err)
				args = append(args, "--listen-addr", fmt.Sprintf("127.0.0.1:%d", listen))
			}
			args = append(args, pgtest.PoolerFlags(db.URL)...)
			if name == "doctor" {
				// doctor is a CLI; its daemon is `leasehold-doctor serve`,
				// with DoctorService on a port of its own.
				apiPort, err := pglocal.FreePort()
				require.NoError(t, err)
				args = append([]string{"serve", "--listen-addr", fmt.Sprintf("127.0.0.1:%d", apiPort)}, args...)
			}
			env := []string{"LEASEHOLD_DATABASE_URL=" + db.URL, "LEASEHOLD_API_TOKENS=admin:devstack-test-token-0123"}
			p := proctest.Start(t, name, bin, env, args...)
			p.WaitReady(30 * time.Second)
			code, _, err := p.Get("/livez", "")
			require.NoError(t, err)
			require.Equal(t, http.StatusOK, code)
			code, body, err := p.Get("/metrics", "")
			require.NoError(t, err)
			require.Equal(t, http.StatusOK, code)
			require.Contains(t, body, "process_cpu_seconds_total")
			require.Contains(t, body, `leasehold_build_info{goversion="`, "every service exports its build")
			code, _, err = p.Get("/healthz/detail", "")
			require.NoError(t, err)
			require.Equal(t, http.StatusUnauthorized, code)
			code, body, err = p.Get("/healthz/detail", "tok")
			require.NoError(t, err)
			require.Equal(t, http.StatusOK, code)
			require.Contains(t, body, `"build": {`, "the build is in /healthz/detail")

			p.Signal(syscall.SIGTERM)
			require.Equal(t, 0, p.Wait(30*time.Second), p.Logs())
			require.True(t, strings.Contains(p.Logs(), "stopped cleanly"), p.Logs())
		})
	}
}

// devstackBins builds the four services of the stack and the node agent
// into one directory, named as `make build` names them, and devstack itself.
func devstackBins(t *testing.T) (binDir, devstack string) {
	t.Helper()
	binDir = t.TempDir()
	for _, name := range []string{"worker", "scheduler", "gateway", "api", "node"} {
		require.NoError(t, os.Symlink(proctest.Build(t, "../../services/"+name), filepath.Join(binDir, "leasehold-"+name)))
	}
	require.NoError(t, os.Symlink(proctest.Build(t, "../../services/cli"), filepath.Join(binDir, "leasehold")))
	return binDir, proctest.Build(t, ".")
}

// directURL is db's URL straight to the server, never through the
// PgBouncer pkg/pgtest may put in front of it: the dev stack's services
// are not told about a pooler.
func directURL(t *testing.T, db *pgtest.DB) string {
	t.Helper()
	u, err := url.Parse(pgtest.Server(t).AdminURL())
	require.NoError(t, err)
	u.Path = "/" + db.Name
	return u.String()
}

func freePort(t *testing.T) int {
	t.Helper()
	p, err := pglocal.FreePort()
	require.NoError(t, err)
	return p
}

// TestDevstackRestartsAKilledServiceAndStopsCleanly: `make run`'s stack
// against a real database. A busy default port is replaced (and said so);
// its two nodes join with a join token and run a real command; a service
// killed with SIGKILL is restarted and serves again; SIGTERM stops every
// service and node, devstack exits 0, leaving no child behind and no lease
// held.
func TestDevstackRestartsAKilledServiceAndStopsCleanly(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the whole stack")
	}
	db := pgtest.NewDB(t)
	binDir, bin := devstackBins(t)
	// Hold the worker's default health port (if nothing else does already).
	if ln, err := net.Listen("tcp", "127.0.0.1:9101"); err == nil {
		defer ln.Close()
	}
	apiPort, gwPort := freePort(t), freePort(t)
	cliConfig := filepath.Join(t.TempDir(), "leasehold", "config.yaml")
	stackDir := t.TempDir()
	p := proctest.Start(t, "devstack", bin, []string{"LEASEHOLD_DATABASE_URL=" + directURL(t, db), "LEASEHOLD_CONFIG=" + cliConfig},
		"-bin", binDir, "-dir", stackDir, "-restart-backoff", "100ms", "-restart-backoff-max", "2s",
		"-api-port", fmt.Sprint(apiPort), "-gateway-port", fmt.Sprint(gwPort))
	require.Eventually(t, func() bool { return strings.Contains(p.Logs(), "leasehold is running") || p.Exited() },
		3*time.Minute, 100*time.Millisecond)
	require.False(t, p.Exited(), p.Logs())
	logs := p.Logs()
	require.Contains(t, logs, "port 9101 for the health endpoints")
	require.Contains(t, logs, fmt.Sprintf("connect to the gateway at http://127.0.0.1:%d", gwPort))
	require.Contains(t, logs, fmt.Sprintf("http://127.0.0.1:%d/leasehold.control.v1.ControlService/ListWorkers", apiPort))
	m := regexp.MustCompile(`worker +http://(127\.0\.0\.1:\d+)/readyz`).FindStringSubmatch(logs)
	require.NotNil(t, m, logs)
	workerHealth := m[1]
	require.NotEqual(t, "127.0.0.1:9101", workerHealth)
	require.Equal(t, 2, strings.Count(logs, `msg="dev node joined"`), logs)
	runOnDevNode(t, apiPort)
	runCommandKindExamples(t, apiPort, stackDir)
	// The quick start's CLI line works as printed: make run wrote the
	// context dev.
	require.Contains(t, logs, "bin/leasehold run dev-node-1 -- uname -a")
	cli := exec.Command(filepath.Join(binDir, "leasehold"), "run", "dev-node-1", "--", "uname", "-a")
	cli.Env = []string{"PATH=/usr/bin:/bin", "LEASEHOLD_CONFIG=" + cliConfig}
	out, err := cli.CombinedOutput()
	require.NoError(t, err, string(out))
	want, err := exec.Command("uname", "-a").Output()
	require.NoError(t, err)
	require.Contains(t, string(out), strings.TrimSpace(string(want)))

	startedRE := regexp.MustCompile(`msg="service started" service=worker pid=(\d+)`)
	pids := func() []int {
		var out []int
		for _, m := range startedRE.FindAllStringSubmatch(p.Logs(), -1) {
			n, _ := strconv.Atoi(m[1])
			out = append(out, n)
		}
		return out
	}
	first := pids()
	require.Len(t, first, 1)
	require.NoError(t, syscall.Kill(first[0], syscall.SIGKILL))

	require.Eventually(t, func() bool { return len(pids()) == 2 }, time.Minute, 50*time.Millisecond, "the killed worker is started again")
	require.Contains(t, p.Logs(), `msg="service exited; restarting it" service=worker status="signal: killed"`)
	second := pids()[1]
	require.NotEqual(t, first[0], second)
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://" + workerHealth + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 2*time.Minute, 100*time.Millisecond, "the restarted worker serves on its port again")

	stopAt := time.Now()
	p.Signal(syscall.SIGTERM)
	require.Equal(t, 0, p.Wait(2*time.Minute), p.Logs())
	// Every child stopped on its own within its grace (the dev gateway
	// drains its nodes in 2 s + 1 s): none was SIGKILLed, so each released
	// its leases. How long the stop took is logged, not asserted (a busy
	// machine stretches it; the mechanism is what is checked).
	t.Logf("the stack stopped %s after SIGTERM with two nodes connected", time.Since(stopAt).Round(time.Millisecond))
	require.NotContains(t, p.Logs(), "service did not stop in time")
	require.Contains(t, p.Logs(), "stopping the services")
	require.Equal(t, 2, strings.Count(p.Logs(), "service started\" service=worker"), "no restart while stopping")
	require.ErrorIs(t, syscall.Kill(second, 0), syscall.ESRCH, "the worker was stopped with the stack")
	var held []string
	rows, err := db.Pool.Query(context.Background(), `SELECT name || ' by ' || owner FROM leases WHERE owner IS NOT NULL`)
	require.NoError(t, err)
	held, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Empty(t, held, "every service released its leases on the way out")
}

// runOnDevNode runs `uname -a` on dev-node-1 through the dev stack's api,
// as the quick start does, and checks the output is this machine's.
func runOnDevNode(t *testing.T, apiPort int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c := controlv1connect.NewControlServiceClient(http.DefaultClient, fmt.Sprintf("http://127.0.0.1:%d", apiPort))
	auth := func(r connect.AnyRequest) { r.Header().Set("Authorization", "Bearer "+apiToken) }
	req := connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "dev-node-1", Kind: "exec", Payload: []byte(`{"argv":["uname","-a"]}`)})
	auth(req)
	created, err := c.CreateCommand(ctx, req)
	require.NoError(t, err)
	wreq := connect.NewRequest(&controlv1.WaitCommandRequest{CommandId: created.Msg.GetCommand().GetId(), Timeout: durationpb.New(time.Minute)})
	auth(wreq)
	w, err := c.WaitCommand(ctx, wreq)
	require.NoError(t, err)
	require.Equal(t, controlv1.CommandState_COMMAND_STATE_SUCCEEDED, w.Msg.GetCommand().GetState(), "%v", w.Msg.GetResult())
	want, err := exec.Command("uname", "-a").Output()
	require.NoError(t, err)
	require.Contains(t, string(w.Msg.GetResult().GetOutput()), strings.TrimSpace(string(want)))
}

// TestDevstackRefusesABusyExplicitPort: a port asked for explicitly that
// another process holds is refused with its number and the flag, before
// any service starts.
func TestDevstackRefusesABusyExplicitPort(t *testing.T) {
	db := pgtest.NewDB(t)
	bin := proctest.Build(t, ".")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	busy := ln.Addr().(*net.TCPAddr).Port
	p := proctest.Start(t, "devstack", bin, []string{"LEASEHOLD_DATABASE_URL=" + directURL(t, db), fmt.Sprintf("LEASEHOLD_DEV_API_PORT=%d", busy)},
		"-bin", t.TempDir())
	require.Equal(t, 1, p.Wait(time.Minute), p.Logs())
	require.Contains(t, p.Logs(), fmt.Sprintf("port %d for the api (ControlService) (-api-port / LEASEHOLD_DEV_API_PORT) is already in use", busy))
	require.NotContains(t, p.Logs(), "service started")
}

// TestEveryBinaryReportsItsVersion: --version exits 0 without any
// configuration and prints what -ldflags -X stamped, as `make build` and
// the Dockerfile stamp it.
func TestEveryBinaryReportsItsVersion(t *testing.T) {
	if testing.Short() {
		t.Skip("builds every binary")
	}
	out := t.TempDir()
	const version, revision = "v9.8.7-test", "0123456789abcdef0123456789abcdef01234567"
	ldflags := "-X github.com/leasehold/leasehold/pkg/buildinfo.version=" + version + " -X github.com/leasehold/leasehold/pkg/buildinfo.revision=" + revision
	for _, name := range []string{"worker", "scheduler", "gateway", "api", "site-agent", "doctor", "node", "devstack"} {
		dir := "../../services/" + name
		if name == "devstack" {
			dir = "."
		}
		bin := filepath.Join(out, name)
		build := exec.Command("go", "build", "-ldflags", ldflags, "-o", bin, ".")
		build.Dir = dir
		b, err := build.CombinedOutput()
		require.NoError(t, err, string(b))
		cmd := exec.Command(bin, "--version")
		cmd.Env = []string{"PATH=/usr/bin:/bin"} // no database, no configuration
		got, err := cmd.Output()
		require.NoError(t, err, name)
		require.Equal(t, fmt.Sprintf("leasehold-%s %s (revision %s, %s)\n", name, version, revision, runtime.Version()), string(got))
	}
}
