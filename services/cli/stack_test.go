package main_test

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/leasehold/leasehold/pkg/apiclient"
	"github.com/leasehold/leasehold/pkg/daemon"
	"github.com/leasehold/leasehold/pkg/fleettest"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	"github.com/leasehold/leasehold/pkg/nodeexec"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var update = flag.Bool("update", false, "rewrite the golden files under testdata/")

const (
	adminToken  = "cli-test-admin-token-0001"
	viewerToken = "cli-test-viewer-token-001"
	relayToken  = "cli-test-relay-shared-token-0123456789"
)

// cliBinary builds the leasehold binary once per test binary.
func cliBinary(t testing.TB) string {
	t.Helper()
	return proctest.Build(t, ".")
}

// cliEnv is the environment of a CLI run: its own config file and HOME,
// and nothing of the caller's LEASEHOLD_* variables.
type cliEnv struct {
	bin string
	dir string
	env []string
}

func newCLIEnv(t *testing.T, extra ...string) *cliEnv {
	t.Helper()
	dir := t.TempDir()
	env := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + dir, "LEASEHOLD_CONFIG=" + filepath.Join(dir, "config.yaml"), "TERM=dumb"}
	return &cliEnv{bin: cliBinary(t), dir: dir, env: append(env, extra...)}
}

func (e *cliEnv) config() string { return filepath.Join(e.dir, "config.yaml") }

// result is one run of the binary.
type result struct {
	stdout, stderr string
	code           int
}

// run runs the CLI to its end (at most a minute) and logs it as a shell
// transcript.
func (e *cliEnv) run(t *testing.T, args ...string) result {
	t.Helper()
	return e.runIn(t, "", args...)
}

func (e *cliEnv) runIn(t *testing.T, stdin string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, e.bin, args...)
	cmd.Env = e.env
	cmd.Stdin = strings.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	r := result{stdout: out.String(), stderr: errb.String()}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		r.code = ee.ExitCode()
	default:
		t.Fatalf("leasehold %s: %v", strings.Join(args, " "), err)
	}
	t.Logf("$ leasehold %s\n%s%s(exit %d)", strings.Join(args, " "), r.stdout, r.stderr, r.code)
	return r
}

// start runs the CLI in the background; its output is collected.
type bg struct {
	cmd            *exec.Cmd
	stdout, stderr *proctest.Buffer
	done           chan struct{}
	code           int
}

func (e *cliEnv) start(t *testing.T, args ...string) *bg {
	t.Helper()
	cmd := exec.Command(e.bin, args...)
	cmd.Env = e.env
	b := &bg{cmd: cmd, stdout: &proctest.Buffer{}, stderr: &proctest.Buffer{}, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = b.stdout, b.stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("start leasehold: %v", err)
	}
	go func() {
		err := cmd.Wait()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			b.code = ee.ExitCode()
		} else if err != nil {
			b.code = -1
		}
		close(b.done)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-b.done
	})
	return b
}

// wait waits for the background run to end and returns its status.
func (b *bg) wait(t *testing.T, timeout time.Duration) int {
	t.Helper()
	select {
	case <-b.done:
		return b.code
	case <-time.After(timeout):
		// A goroutine dump says where it hangs.
		_ = b.cmd.Process.Signal(syscall.SIGQUIT)
		select {
		case <-b.done:
		case <-time.After(5 * time.Second):
		}
		t.Fatalf("leasehold %v still running after %s\nstdout:\n%s\nstderr:\n%s", b.cmd.Args[1:], timeout, b.stdout, b.stderr)
		return -1
	}
}

// eventually polls cond every 50 ms until it holds or timeout passes.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %s: %s", timeout, what)
		}
		time.Sleep(50 * time.Millisecond) // poll interval
	}
}

// stack is a real control plane: PostgreSQL, a gateway with its tunnel
// relay, a worker, an api, and three in-process daemons running the real
// executor of typed kinds.
type stack struct {
	db *pgtest.DB
	// relayTokenFile is the gateways' relay token, for another api.
	relayTokenFile string
	apiURL         string
	client         controlv1connect.ControlServiceClient
	nodes          []string
	webPort        uint32
}

var nodeLabels = []map[string]string{
	{"rack": "r1", "role": "web"},
	{"rack": "r1", "role": "db"},
	{"rack": "r2", "role": "web"},
}

func startStack(t *testing.T) *stack {
	t.Helper()
	db := pgtest.NewDB(t)
	ids, creds := fleettest.RegisterNodes(t, db.Pool, "node", 3)
	tokenFile := filepath.Join(t.TempDir(), "relay-token")
	if err := os.WriteFile(tokenFile, []byte(relayToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	gw := fleettest.StartGateway(t, db.URL, "gw_cli", append([]string{"--gateway.relay-listen-addr", fleettest.Addr(t),
		"--gateway.relay-token-file", tokenFile}, fleettest.FastGateway...)...)
	fleettest.StartService(t, "worker", db.URL, "worker_cli", fleettest.FastCoord...)
	apiAddr := fleettest.Addr(t)
	args := append([]string{"--database-url", db.URL, "--http-addr", fleettest.Addr(t), "--id", "api_cli", "--log-format", "text",
		"--listen-addr", apiAddr, "--api.relay-token-file", tokenFile, "--api.wait-poll-interval", "500ms"}, fleettest.DBFlags(db.URL)...)
	api := proctest.Start(t, "api_cli", apiBinary(t),
		[]string{"LEASEHOLD_API_TOKENS=admin:" + adminToken + ",viewer:" + viewerToken}, args...)
	api.WaitReady(60 * time.Second)

	webPort := httpServer(t)
	for i, id := range ids {
		cfg := nodeexec.DefaultConfig()
		cfg.KillGrace, cfg.Version = 2*time.Second, "v-test"
		exe, err := nodeexec.New(cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		d, err := daemon.New(daemon.Config{Address: gw.URL(), NodeID: id, Credential: creds[i], Handler: exe.Handle,
			Labels: nodeLabels[i], Version: "v-test", BackoffBase: 50 * time.Millisecond, BackoffMax: 500 * time.Millisecond,
			OutputFlush: 20 * time.Millisecond, TunnelPorts: []uint32{webPort}, TunnelShell: []string{"/bin/sh"}})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		wg.Go(func() { _ = d.Run(ctx) })
		t.Cleanup(func() { cancel(); wg.Wait(); exe.Close() })
	}
	s := &stack{db: db, relayTokenFile: tokenFile, apiURL: "http://" + apiAddr, nodes: ids, webPort: webPort,
		client: controlv1connect.NewControlServiceClient(http.DefaultClient, "http://"+apiAddr,
			connect.WithInterceptors(apiclient.NewBearer(apiclient.StaticToken(adminToken))))}
	eventually(t, time.Minute, "every node connected", func() bool {
		res, err := s.client.ListNodes(context.Background(), connect.NewRequest(&controlv1.ListNodesRequest{State: controlv1.NodeState_NODE_STATE_CONNECTED}))
		return err == nil && len(res.Msg.GetNodes()) == len(ids)
	})
	return s
}

// startTLSAPI starts a second api serving TLS with certFile and keyFile
// and returns its https URL.
func (s *stack) startTLSAPI(t *testing.T, certFile, keyFile string) string {
	t.Helper()
	return "https://" + s.startAPI(t, "api_cli_tls", "--api.tls-cert", certFile, "--api.tls-key", keyFile)
}

// startAPI starts another api on the stack's database, known as id, with
// extra flags, and returns its address.
func (s *stack) startAPI(t *testing.T, id string, extra ...string) string {
	t.Helper()
	addr := fleettest.Addr(t)
	args := append([]string{"--database-url", s.db.URL, "--http-addr", fleettest.Addr(t), "--id", id, "--log-format", "text",
		"--listen-addr", addr, "--api.relay-token-file", s.relayTokenFile}, fleettest.DBFlags(s.db.URL)...)
	p := proctest.Start(t, id, apiBinary(t), []string{"LEASEHOLD_API_TOKENS=admin:" + adminToken}, append(args, extra...)...)
	p.WaitReady(60 * time.Second)
	return addr
}

// apiBinary is leasehold-api built from this tree, or the binary named by
// LEASEHOLD_CLI_TEST_API (for a tree whose api does not build at the moment).
func apiBinary(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("LEASEHOLD_CLI_TEST_API"); p != "" {
		return p
	}
	return fleettest.Binary(t, "api")
}

// httpServer serves "hello from the node's side: <path>" on a loopback port.
func httpServer(t *testing.T) uint32 {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = fmt.Fprintf(w, "hello from the node's side: %s\n", r.URL.Path)
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return uint32(ln.Addr().(*net.TCPAddr).Port)
}

// The golden files hold outputs with what changes from run to run
// replaced: times, ages, ids, epochs, durations.
var normalizers = []struct {
	re   *regexp.Regexp
	with string
}{
	{regexp.MustCompile(`\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z`), "<time>"},
	{uuidRE, "<uuid>"},
	{regexp.MustCompile(`"(sessionEpoch|epoch|leaseEpoch)": "\d+"`), `"$1": "<n>"`},
	{regexp.MustCompile(`\b(sessionEpoch|epoch|leaseEpoch): "\d+"`), `$1: "<n>"`},
	{regexp.MustCompile(`(?m)^(Session epoch: +)\d+$`), "${1}<n>"},
	{regexp.MustCompile(`"clockSkew": "[-0-9.]+s"`), `"clockSkew": "<dur>"`},
	{regexp.MustCompile(`\b[0-9a-f]{16}\b`), "<id>"},
	// An audit event's id: the number a table row starts with.
	{regexp.MustCompile(`(?m)^\d+( {3,})`), "<n>$1"},
	{regexp.MustCompile(`\bin \d+[smhd]\b`), "in <age>"},
	// An age in a table cell (after the padding) or in parentheses; not a
	// duration of YAML, "key: 3600s".
	{regexp.MustCompile(`(?m)(^|\s{2,}|\()\d+[smhd](\s|\)|$)`), "$1<age>$2"},
}

// uuidRE matches the ids of runs and commands.
var uuidRE = regexp.MustCompile(`[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}`)

func normalize(s string) string {
	for _, n := range normalizers {
		s = n.re.ReplaceAllString(s, n.with)
	}
	return s
}

// normalizeTable also replaces the numbers of the epoch columns (a column
// whose header ends in EPOCH) and collapses the padding between columns,
// which moves with the width of what was normalized.
func normalizeTable(s string) string {
	s = normalize(epochColumns(s))
	return regexp.MustCompile(` {2,}`).ReplaceAllString(s, "   ")
}

var (
	// tableHeaderRE matches a table's header line: upper-case cells, apart
	// by at least two spaces.
	tableHeaderRE = regexp.MustCompile(`^ *[A-Z]+( [A-Z]+)*( {2,}[A-Z]+( [A-Z]+)*)+$`)
	headerCellRE  = regexp.MustCompile(`[A-Z]+( [A-Z]+)*`)
	leadingNumRE  = regexp.MustCompile(`^\d+`)
)

// epochColumns replaces with <n> the number that starts each cell of an
// epoch column, from its header down to the table's end (an empty line).
// It reads the cells at their header's offset, so it runs on the aligned
// output, before anything changed its widths.
func epochColumns(s string) string {
	lines := strings.Split(s, "\n")
	var cols []int
	for i, l := range lines {
		if tableHeaderRE.MatchString(l) {
			cols = nil
			for _, m := range headerCellRE.FindAllStringIndex(l, -1) {
				if strings.HasSuffix(l[m[0]:m[1]], "EPOCH") {
					cols = append(cols, m[0])
				}
			}
			continue
		}
		if l == "" {
			cols = nil
		}
		for j := len(cols) - 1; j >= 0; j-- {
			if c := cols[j]; c < len(l) {
				lines[i] = l[:c] + leadingNumRE.ReplaceAllString(l[c:], "<n>")
				l = lines[i]
			}
		}
	}
	return strings.Join(lines, "\n")
}

func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	if *update {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (go test -run %s -update writes it)", err, t.Name())
	}
	if string(want) != got {
		t.Fatalf("%s differs from the golden file %s\n--- got:\n%s\n--- want:\n%s", name, path, got, want)
	}
}

func signal(t *testing.T, b *bg, sig syscall.Signal) {
	t.Helper()
	if err := b.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("signal: %v", err)
	}
}
