package main_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/creack/pty"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/leasehold/leasehold/pkg/fleettest"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/proctest"
	"github.com/leasehold/leasehold/pkg/tlstest"
)

func requireCode(t *testing.T, r result, want int) {
	t.Helper()
	if r.code != want {
		t.Fatalf("exit %d, want %d\nstdout:\n%s\nstderr:\n%s", r.code, want, r.stdout, r.stderr)
	}
}

func requireContains(t *testing.T, s, want string) {
	t.Helper()
	if !strings.Contains(s, want) {
		t.Fatalf("%q not in:\n%s", want, s)
	}
}

// TestContextsAndUsage needs no api: contexts are written 0600 and
// atomically, other contexts are left alone, a file with group or other
// access or with unknown keys is refused naming it, bad usage exits 2 with
// a message naming the flag, and a missing context says how to make one.
func TestContextsAndUsage(t *testing.T) {
	t.Parallel()
	e := newCLIEnv(t, "LEASEHOLD_TOKEN=not-used-here-0123456789")

	r := e.run(t, "nodes", "ls")
	requireCode(t, r, 2)
	requireContains(t, r.stderr, "leasehold: no context")
	requireContains(t, r.stderr, "leasehold context set dev --api http://127.0.0.1:8080 --token-env LEASEHOLD_TOKEN")

	requireCode(t, e.run(t, "context", "set", "prod", "--api", "https://api.example:8443", "--token-file", "/etc/leasehold/token"), 0)
	requireCode(t, e.run(t, "context", "set", "dev", "--api", "http://127.0.0.1:8080", "--token-env", "LEASEHOLD_DEV_TOKEN"), 0)
	st, err := os.Stat(e.config())
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Fatalf("config file mode %v, want 0600", st.Mode().Perm())
	}
	r = e.run(t, "context", "ls")
	requireCode(t, r, 0)
	golden(t, "context-ls", r.stdout)
	// The dev stack's hook again, with a new port: dev is updated, prod
	// stays current and untouched.
	requireCode(t, e.run(t, "context", "set", "dev", "--api", "http://127.0.0.1:18080", "--token-env", "LEASEHOLD_DEV_TOKEN"), 0)
	b, _ := os.ReadFile(e.config())
	want := "current-context: prod\ncontexts:\n  dev:\n    api: http://127.0.0.1:18080\n    token-env: LEASEHOLD_DEV_TOKEN\n  prod:\n    api: https://api.example:8443\n    token-file: /etc/leasehold/token\n"
	if string(b) != want {
		t.Fatalf("config file:\n%s\nwant:\n%s", b, want)
	}
	// Completion: the scripts, and context names completed from the file.
	r = e.run(t, "completion", "bash")
	requireCode(t, r, 0)
	requireContains(t, r.stdout, "__start_leasehold")
	for _, sh := range []string{"zsh", "fish"} {
		requireCode(t, e.run(t, "completion", sh), 0)
	}
	r = e.run(t, "__complete", "context", "use", "")
	requireCode(t, r, 0)
	if !strings.HasPrefix(r.stdout, "dev\nprod\n:4\n") {
		t.Fatalf("context completion: %q", r.stdout)
	}
	requireCode(t, e.run(t, "context", "use", "dev"), 0)
	requireCode(t, e.run(t, "context", "delete", "prod"), 0)
	r = e.run(t, "context", "use", "nope")
	requireCode(t, r, 2)
	requireContains(t, r.stderr, `no context "nope"`)

	// Bad input writes nothing.
	before, _ := os.ReadFile(e.config())
	for _, bad := range [][]string{
		{"context", "set", "x", "--api", "ftp://h"},
		{"context", "set", "x", "--api", "http://h", "--token-file", "f", "--token-env", "V"},
		{"context", "set", "x", "--api", "http://h", "--token-env", "1BAD"},
		{"context", "set", "bad/name", "--api", "http://h"},
		{"context", "set", "x"},
	} {
		requireCode(t, e.run(t, bad...), 2)
	}
	after, _ := os.ReadFile(e.config())
	if string(before) != string(after) {
		t.Fatalf("a refused context set changed the file:\n%s", after)
	}

	// Usage errors: exit 2, naming the flag.
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"nodes", "ls", "-l", "rack in (r1"}, "-l: selector"},
		{[]string{"nodes", "ls", "-l", "rack=r1,,role"}, "-l: selector"},
		{[]string{"nodes", "ls", "-l", "!"}, "-l: selector"},
		{[]string{"nodes", "ls", "-l", "rack notin r1"}, "-l: selector"},
		{[]string{"nodes", "ls", "-o", "xml"}, "-o/--output: unknown format \"xml\""},
		{[]string{"nodes", "ls", "--state", "sleepy"}, "--state"},
		{[]string{"nodes", "ls", "--bogus"}, "unknown flag: --bogus"},
		{[]string{"run", "node-0", "uname"}, "put it after --"},
		{[]string{"run", "--", "uname"}, "no node"},
		{[]string{"run", "node-0", "--max-in-flight", "0", "--", "true"}, "--max-in-flight \"0\": must be at least 1"},
		{[]string{"run", "node-0", "--max-in-flight", "120%", "--", "true"}, "--max-in-flight \"120%\": a percentage must be at most 100%"},
		{[]string{"run", "node-0", "--max-failures", "some", "--", "true"}, "--max-failures \"some\": want a number or a percentage"},
		{[]string{"run", "node-0", "--pause", "2h", "--", "true"}, "--pause"},
		{[]string{"runs", "get"}, "want RUN"},
		{[]string{"join-tokens", "create", "--ttl", "1s"}, "--ttl"},
		{[]string{"join-tokens", "create", "--label", "=x"}, "--label"},
		{[]string{"port-forward", "node-0", "80"}, "LOCAL:REMOTE"},
		{[]string{"nodes", "get"}, "want NODE"},
		{[]string{"frobnicate"}, "unknown command"},
	} {
		r := e.run(t, c.args...)
		requireCode(t, r, 2)
		requireContains(t, r.stderr, c.want)
		if n := strings.Count(strings.TrimSpace(r.stderr), "\n"); n > 1 {
			t.Fatalf("%v: the error takes %d lines:\n%s", c.args, n+1, r.stderr)
		}
	}

	// A config file others may read is refused, naming it; so is one with
	// an unknown key.
	if err := os.Chmod(e.config(), 0o644); err != nil {
		t.Fatal(err)
	}
	r = e.run(t, "context", "ls")
	requireCode(t, r, 1)
	requireContains(t, r.stderr, "config file "+e.config()+" has mode 0644")
	if err := os.Chmod(e.config(), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(e.config(), []byte("current-context: dev\ncontexts:\n  dev:\n    api: http://h:1\n    token: s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	r = e.run(t, "nodes", "ls")
	requireCode(t, r, 1)
	requireContains(t, r.stderr, "config file "+e.config())
	requireContains(t, r.stderr, "field token not found")
}

// TestSelectorParse covers the selector forms through the binary's -l on a
// stack-less run: every valid form parses (the failure is then the missing
// context, exit 2 without "-l" in it).
func TestSelectorParse(t *testing.T) {
	t.Parallel()
	e := newCLIEnv(t)
	for _, ok := range []string{"rack=r1", "rack==r1", "rack!=r1", "rack in (r1, r2)", "rack notin (r1)", "rack", "!rack",
		"rack=r1,role in (web,db),!canary", " rack = r1 ", "example.com/zone=a"} {
		r := e.run(t, "nodes", "ls", "-l", ok)
		requireCode(t, r, 2)
		if strings.Contains(r.stderr, "-l") {
			t.Fatalf("selector %q refused: %s", ok, r.stderr)
		}
	}
}

// TestCLI runs the binary against a real stack (PostgreSQL, gateway with
// relay, worker, api, three daemons running the real exec executor).
func TestCLI(t *testing.T) {
	t.Parallel()
	s := startStack(t)
	e := newCLIEnv(t, "LEASEHOLD_TEST_TOKEN="+adminToken, "LEASEHOLD_VIEWER_TOKEN="+viewerToken)
	requireCode(t, e.run(t, "context", "set", "test", "--api", s.apiURL, "--token-env", "LEASEHOLD_TEST_TOKEN"), 0)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	t.Run("nodes ls golden", func(t *testing.T) {
		r := e.run(t, "nodes", "ls")
		requireCode(t, r, 0)
		golden(t, "nodes-ls", normalizeTable(r.stdout))
		r = e.run(t, "nodes", "ls", "-o", "json")
		requireCode(t, r, 0)
		golden(t, "nodes-ls-json", normalize(r.stdout))
		r = e.run(t, "nodes", "ls", "-o", "yaml")
		requireCode(t, r, 0)
		golden(t, "nodes-ls-yaml", normalize(r.stdout))
		// -o wide adds where each session lives: the gateway, its epoch, the
		// daemon's version and when the node was created (no pool here: "-").
		r = e.run(t, "nodes", "ls", "-o", "wide")
		requireCode(t, r, 0)
		golden(t, "nodes-ls-wide", normalizeTable(r.stdout))
		lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
		if len(lines) != 4 || !regexp.MustCompile(`^NODE +STATE +CORDONED +LABELS +LAST SEEN +POOL +GATEWAY +EPOCH +VERSION +CREATED$`).MatchString(lines[0]) {
			t.Fatalf("nodes ls -o wide header or row count:\n%s", r.stdout)
		}
		row := regexp.MustCompile(`^node-[0-2] +connected +no +rack=r[12],role=(web|db) +\S+ +- +gw_cli +[1-9][0-9]* +v-test +\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d`)
		for _, l := range lines[1:] {
			if !row.MatchString(l) {
				t.Fatalf("nodes ls -o wide row %q does not name the gateway, epoch, version and creation time:\n%s", l, r.stdout)
			}
		}
		r = e.run(t, "nodes", "ls", "-l", "role=web,rack notin (r2)")
		requireCode(t, r, 0)
		golden(t, "nodes-ls-selector", normalizeTable(r.stdout))
		r = e.run(t, "nodes", "ls", "-l", "!role", "--state", "connected")
		requireCode(t, r, 0)
		if strings.Count(r.stdout, "\n") != 1 {
			t.Fatalf("!role matched nodes:\n%s", r.stdout)
		}
		r = e.run(t, "nodes", "get", "node-1")
		requireCode(t, r, 0)
		golden(t, "nodes-get", normalizeTable(r.stdout))
		r = e.run(t, "nodes", "get", "node-1", "-o", "wide")
		requireCode(t, r, 0)
		golden(t, "nodes-get-wide", normalizeTable(r.stdout))
		r = e.run(t, "nodes", "get", "node-1", "-o", "yaml")
		requireCode(t, r, 0)
		golden(t, "nodes-get-yaml", normalize(r.stdout))
	})

	t.Run("workers gateways leases golden", func(t *testing.T) {
		eventually(t, 30*time.Second, "the worker is live", func() bool {
			r := e.run(t, "workers")
			return r.code == 0 && strings.Contains(r.stdout, "yes")
		})
		r := e.run(t, "workers")
		requireCode(t, r, 0)
		golden(t, "workers", normalizeTable(r.stdout))
		r = e.run(t, "workers", "-o", "json")
		requireCode(t, r, 0)
		golden(t, "workers-json", normalize(r.stdout))
		r = e.run(t, "gateways")
		requireCode(t, r, 0)
		golden(t, "gateways", normalizeTable(r.stdout))
		r = e.run(t, "leases", "--prefix", "gateway:")
		requireCode(t, r, 0)
		requireContains(t, r.stdout, "gateway:gw_cli")
		golden(t, "leases", normalizeTable(r.stdout))
		r = e.run(t, "leases", "--prefix", "gateway:", "-o", "wide")
		requireCode(t, r, 0)
		golden(t, "leases-wide", normalizeTable(r.stdout))
	})

	t.Run("join tokens", func(t *testing.T) {
		r := e.run(t, "join-tokens", "create", "--uses", "5", "--ttl", "2h", "--label", "rack=r9", "--label", "zone=a", "--description", "racking r9")
		requireCode(t, r, 0)
		first := strings.SplitN(r.stdout, "\n", 2)[0]
		if !regexp.MustCompile(`^lhj_[0-9a-f]{16}\.[A-Za-z0-9_-]+$`).MatchString(first) {
			t.Fatalf("the first line is not the token: %q", first)
		}
		requireContains(t, r.stdout, "5 use(s)")
		r = e.run(t, "join-tokens", "create")
		requireCode(t, r, 0)
		id := strings.TrimPrefix(strings.SplitN(strings.SplitN(r.stdout, "\n", 2)[0], ".", 2)[0], "lhj_")
		requireCode(t, e.run(t, "join-tokens", "revoke", id), 0)
		r = e.run(t, "join-tokens", "ls")
		requireCode(t, r, 0)
		if strings.Contains(r.stdout, "lhj_") || strings.Contains(r.stdout, first) {
			t.Fatalf("ls shows a secret:\n%s", r.stdout)
		}
		golden(t, "join-tokens-ls", normalizeTable(r.stdout))
		r = e.run(t, "join-tokens", "ls", "--all", "-o", "json")
		requireCode(t, r, 0)
		golden(t, "join-tokens-ls-json", normalize(r.stdout))
		// A bad token request is refused before anything is created.
		requireCode(t, e.run(t, "join-tokens", "create", "--uses", "0"), 2)
		res, err := s.client.ListJoinTokens(ctx, connect.NewRequest(&controlv1.ListJoinTokensRequest{IncludeInactive: true}))
		if err != nil {
			t.Fatal(err)
		}
		if n := len(res.Msg.GetJoinTokens()); n != 2 {
			t.Fatalf("%d join tokens, want 2", n)
		}
	})

	t.Run("errors: exit 1, unauthenticated, not found", func(t *testing.T) {
		r := e.run(t, "nodes", "get", "no-such-node")
		requireCode(t, r, 1)
		if got := strings.TrimSpace(r.stderr); got != "leasehold: not_found: node no-such-node not found" && !strings.HasPrefix(got, "leasehold: not_found: ") {
			t.Fatalf("stderr: %q", got)
		}
		bad := newCLIEnv(t, "WRONG="+"cli-test-not-a-known-token-42")
		requireCode(t, bad.run(t, "context", "set", "stale", "--api", s.apiURL, "--token-env", "WRONG"), 0)
		r = bad.run(t, "nodes", "ls", "-v")
		requireCode(t, r, 1)
		requireContains(t, r.stderr, "leasehold: unauthenticated: ")
		requireContains(t, r.stderr, `context "stale"`)
		requireContains(t, r.stderr, "environment variable WRONG")
		if strings.Contains(r.stderr+r.stdout, "cli-test-not-a-known-token-42") {
			t.Fatalf("the token was printed:\n%s", r.stderr)
		}
		// A viewer may list but not cordon.
		r = e.run(t, "--context", "test", "--token-file", writeFile(t, viewerToken), "cordon", "node-1")
		requireCode(t, r, 1)
		requireContains(t, r.stderr, "leasehold: permission_denied: ")
		r = e.run(t, "-v", "nodes", "ls")
		requireCode(t, r, 0)
		if strings.Contains(r.stderr, adminToken) {
			t.Fatal("-v printed the token")
		}
		requireContains(t, r.stderr, "token from environment variable LEASEHOLD_TEST_TOKEN")
	})

	t.Run("run: bad budgets are usage errors, nothing created", func(t *testing.T) {
		for _, c := range []struct{ flag, value string }{
			{"--max-in-flight", "0"}, {"--max-in-flight", "0%"}, {"--max-in-flight", "101%"}, {"--max-in-flight", "ten"},
			{"--max-in-flight", "-1"}, {"--max-failures", "150%"}, {"--max-failures", "1.5"}, {"--max-failures", "x%"},
		} {
			r := e.run(t, "run", "node-0", "node-1", c.flag, c.value, "--", "true")
			requireCode(t, r, 2)
			requireContains(t, r.stderr, "leasehold: "+c.flag+" ")
		}
		if runs := listRuns(t, ctx, s); len(runs) != 0 {
			t.Fatalf("usage errors created %d run(s)", len(runs))
		}
	})

	t.Run("run on one node", func(t *testing.T) {
		r := e.run(t, "run", "node-1", "--", "sh", "-c", "echo out; echo err >&2")
		requireCode(t, r, 0)
		if r.stdout != "out\n" || r.stderr != "err\n" {
			t.Fatalf("one node: no prefix, streams apart; got stdout %q stderr %q", r.stdout, r.stderr)
		}
		r = e.run(t, "run", "node-1", "--", "sh", "-c", "exit 4")
		requireCode(t, r, 1)
		requireContains(t, r.stderr, "node-1: failed: exit code 4")
	})

	t.Run("run across three nodes", func(t *testing.T) {
		marker := t.TempDir()
		// One window slot: node-0 runs first (runs start nodes in id
		// order) and makes the directory, so it is the one that fails; a
		// budget of one failure lets the others run.
		script := "echo hello; if mkdir " + marker + "/first 2>/dev/null; then echo first >&2; exit 3; fi; echo fine"
		r := e.run(t, "run", "node-0", "node-1", "node-2", "--max-in-flight", "1", "--max-failures", "1", "--", "sh", "-c", script)
		requireCode(t, r, 1)
		// The nodes' outputs are followed at once: each node's lines in
		// order, the nodes interleaved as they come.
		for node, want := range map[string]string{"node-0": "hello\n", "node-1": "hello\nfine\n", "node-2": "hello\nfine\n"} {
			if got := linesOf(r.stdout, node); got != want {
				t.Fatalf("%s's stdout %q, want %q; all of it:\n%s", node, got, want, r.stdout)
			}
		}
		requireContains(t, r.stderr, "node-0: first\n")
		sum := normalizeTable(r.stderr)
		requireContains(t, sum, "node-0   failed: exit code 3   <uuid>")
		requireContains(t, sum, "node-1   succeeded   <uuid>")
		requireContains(t, sum, "3 node(s): 2 succeeded, 1 failed\nrun <uuid> failed")
		// One run on the server, with the three nodes.
		runs := listRuns(t, ctx, s)
		got := getRun(t, ctx, s, runs[0].GetId())
		if len(got.GetNodes()) != 3 || got.GetRun().GetState() != controlv1.RunState_RUN_STATE_FAILED || got.GetRun().GetMaxInFlight() != 1 ||
			got.GetNodes()[0].GetState() != controlv1.RunNodeState_RUN_NODE_STATE_FAILED || got.GetNodes()[2].GetState() != controlv1.RunNodeState_RUN_NODE_STATE_SUCCEEDED {
			t.Fatalf("the run: %v", got)
		}
		requireContains(t, r.stderr, "leasehold: run "+runs[0].GetId()+": 3 nodes, at most 1 at once, failure budget 1\n")

		// logs RUN prints every node's output again, prefixed, node after
		// node; -f follows the (ended) run the way run does.
		r = e.run(t, "logs", runs[0].GetId())
		requireCode(t, r, 0)
		if want := "node-0: hello\nnode-1: hello\nnode-1: fine\nnode-2: hello\nnode-2: fine\n"; r.stdout != want {
			t.Fatalf("logs RUN stdout %q, want %q", r.stdout, want)
		}
		if r.stderr != "node-0: first\n" {
			t.Fatalf("logs RUN stderr %q", r.stderr)
		}
		r = e.run(t, "logs", "-f", runs[0].GetId())
		requireCode(t, r, 0)
		for node, want := range map[string]string{"node-0": "hello\n", "node-1": "hello\nfine\n", "node-2": "hello\nfine\n"} {
			if got := linesOf(r.stdout, node); got != want {
				t.Fatalf("logs -f RUN: %s's stdout %q, want %q; all of it:\n%s", node, got, want, r.stdout)
			}
		}
	})

	t.Run("run: a failure budget of 0 stops new starts", func(t *testing.T) {
		marker := t.TempDir()
		script := "echo hello; if mkdir " + marker + "/first 2>/dev/null; then echo first >&2; exit 3; fi; echo fine"
		r := e.run(t, "run", "node-0", "node-1", "node-2", "--max-in-flight", "1", "--", "sh", "-c", script)
		requireCode(t, r, 1)
		if r.stdout != "node-0: hello\n" {
			t.Fatalf("stdout:\n%s", r.stdout)
		}
		sum := normalizeTable(r.stderr)
		requireContains(t, sum, "node-0   failed: exit code 3   <uuid>")
		requireContains(t, sum, "node-1   not_started   -")
		requireContains(t, sum, "node-2   not_started   -")
		requireContains(t, sum, "3 node(s): 1 failed, 2 not_started\nrun <uuid> failed")
		runs := listRuns(t, ctx, s)
		got := getRun(t, ctx, s, runs[0].GetId())
		for i, want := range []controlv1.RunNodeState{controlv1.RunNodeState_RUN_NODE_STATE_FAILED,
			controlv1.RunNodeState_RUN_NODE_STATE_NOT_STARTED, controlv1.RunNodeState_RUN_NODE_STATE_NOT_STARTED} {
			if st := got.GetNodes()[i].GetState(); st != want {
				t.Fatalf("node %d is %v, want %v", i, st, want)
			}
		}
		if got.GetRun().GetMaxFailures() != 0 || got.GetRun().GetState() != controlv1.RunState_RUN_STATE_FAILED {
			t.Fatalf("the run: %v", got.GetRun())
		}
	})

	t.Run("run by selector; runs ls and get", func(t *testing.T) {
		// In parallel: node-0 and node-2 are the web nodes.
		r := e.run(t, "run", "-l", "role=web", "--", "sh", "-c", "echo up")
		requireCode(t, r, 0)
		got := strings.Split(strings.TrimSpace(r.stdout), "\n")
		if len(got) != 2 || !contains(got, "node-0: up") || !contains(got, "node-2: up") {
			t.Fatalf("stdout:\n%s", r.stdout)
		}
		requireContains(t, r.stderr, "2 node(s): 2 succeeded\n")
		id := listRuns(t, ctx, s)[0].GetId()

		r = e.run(t, "runs", "ls")
		requireCode(t, r, 0)
		golden(t, "runs-ls", normalizeTable(r.stdout))
		r = e.run(t, "runs", "ls", "--state", "succeeded", "-o", "json")
		requireCode(t, r, 0)
		golden(t, "runs-ls-json", normalize(r.stdout))
		r = e.run(t, "runs", "get", id)
		requireCode(t, r, 0)
		golden(t, "runs-get", normalizeTable(r.stdout))
		r = e.run(t, "runs", "get", id, "-o", "wide")
		requireCode(t, r, 0)
		golden(t, "runs-get-wide", normalizeTable(r.stdout))
		r = e.run(t, "runs", "get", id, "-o", "json")
		requireCode(t, r, 0)
		golden(t, "runs-get-json", normalize(r.stdout))
		r = e.run(t, "runs", "get", id, "-o", "yaml")
		requireCode(t, r, 0)
		golden(t, "runs-get-yaml", normalize(r.stdout))
		r = e.run(t, "runs", "wait", id)
		requireCode(t, r, 0)
		requireContains(t, r.stdout, "run "+id+": succeeded (2 node(s): 2 succeeded)")
		golden(t, "runs-wait", normalize(r.stdout))
		// The run a failure budget of 0 stopped: exit 1, and the line gives
		// the run's reason.
		failed := listRuns(t, ctx, s)[1].GetId()
		r = e.run(t, "runs", "wait", failed)
		requireCode(t, r, 1)
		golden(t, "runs-wait-failed", normalize(r.stdout))
		r = e.run(t, "runs", "ls", "--state", "sleepy")
		requireCode(t, r, 2)
		requireContains(t, r.stderr, "--state")
		r = e.run(t, "runs", "get", "00000000-0000-0000-0000-000000000000")
		requireCode(t, r, 1)
		requireContains(t, r.stderr, "leasehold: not_found: ")
	})

	t.Run("nodes describe, commands ls and get", func(t *testing.T) {
		// node-0's commands so far: one from each of the three runs above.
		r := e.run(t, "nodes", "describe", "node-0")
		requireCode(t, r, 0)
		golden(t, "nodes-describe", normalizeTable(r.stdout))
		r = e.run(t, "commands", "ls", "--node", "node-0")
		requireCode(t, r, 0)
		golden(t, "commands-ls", normalizeTable(r.stdout))
		r = e.run(t, "commands", "ls", "--node", "node-0", "-o", "wide")
		requireCode(t, r, 0)
		golden(t, "commands-ls-wide", normalizeTable(r.stdout))
		last := getRun(t, ctx, s, listRuns(t, ctx, s)[0].GetId())
		r = e.run(t, "commands", "get", last.GetNodes()[0].GetCommandId())
		requireCode(t, r, 0)
		golden(t, "commands-get", normalizeTable(r.stdout))
		// A failed one (node-1's exit 4): its exit code.
		failed := getRun(t, ctx, s, listRuns(t, ctx, s)[3].GetId())
		r = e.run(t, "commands", "get", failed.GetNodes()[0].GetCommandId())
		requireCode(t, r, 0)
		golden(t, "commands-get-failed", normalizeTable(r.stdout))
	})

	t.Run("logs -f follows live output", func(t *testing.T) {
		gate := filepath.Join(t.TempDir(), "go-on")
		id := createExec(t, ctx, s, "node-2", "sh", "-c", "echo first; while [ ! -e "+gate+" ]; do sleep 0.05; done; echo second")
		b := e.start(t, "logs", "-f", id)
		eventually(t, 30*time.Second, "the first line, live", func() bool { return b.stdout.String() == "first\n" })
		select {
		case <-b.done:
			t.Fatal("logs -f ended before the command did")
		default:
		}
		// Without -f, logs prints what is there and ends.
		r := e.run(t, "logs", id)
		requireCode(t, r, 0)
		if r.stdout != "first\n" {
			t.Fatalf("logs without -f: %q", r.stdout)
		}
		if err := os.WriteFile(gate, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if code := b.wait(t, 30*time.Second); code != 0 {
			t.Fatalf("logs -f exited %d: %s", code, b.stderr)
		}
		if b.stdout.String() != "first\nsecond\n" {
			t.Fatalf("logs -f: %q", b.stdout.String())
		}
		r = e.run(t, "commands", "get", id)
		requireCode(t, r, 0)
		requireContains(t, r.stdout, "succeeded")
		r = e.run(t, "commands", "ls", "--node", "node-2", "--limit", "1")
		requireCode(t, r, 0)
		requireContains(t, r.stdout, id)
	})

	t.Run("run: Ctrl-C cancels the run", func(t *testing.T) {
		b := e.start(t, "run", "node-0", "node-1", "--", "sh", "-c", "echo started; sleep 60")
		eventually(t, 30*time.Second, "both commands started", func() bool {
			out := b.stdout.String()
			return strings.Contains(out, "node-0: started\n") && strings.Contains(out, "node-1: started\n")
		})
		signal(t, b, syscall.SIGINT)
		if code := b.wait(t, 30*time.Second); code != 130 {
			t.Fatalf("exit %d, want 130: %s", code, b.stderr)
		}
		stderr := normalizeTable(b.stderr.String())
		requireContains(t, stderr, "leasehold: interrupted: cancelling run <uuid> (Ctrl-C again to exit at once)\n")
		requireContains(t, stderr, "node-0   cancelled")
		requireContains(t, stderr, "leasehold: interrupted: run <uuid> cancelled\n")
		got := getRun(t, ctx, s, listRuns(t, ctx, s)[0].GetId())
		if got.GetRun().GetState() != controlv1.RunState_RUN_STATE_CANCELLED || got.GetRun().GetReason() != "interrupted from the CLI" {
			t.Fatalf("the run: %v", got.GetRun())
		}
		for _, n := range got.GetNodes() {
			if n.GetState() != controlv1.RunNodeState_RUN_NODE_STATE_CANCELLED {
				t.Fatalf("node %s is %v, want cancelled", n.GetNodeId(), n.GetState())
			}
		}

		// A second Ctrl-C exits at once, while the cancelled command (which
		// ignores SIGTERM) is still being stopped on its node.
		b = e.start(t, "run", "node-0", "node-1", "--", "sh", "-c", "trap '' TERM; echo started; sleep 60")
		eventually(t, 30*time.Second, "both commands started", func() bool { return strings.Count(b.stdout.String(), ": started\n") == 2 })
		signal(t, b, syscall.SIGINT)
		eventually(t, 30*time.Second, "the run cancelled", func() bool { return strings.Contains(b.stderr.String(), "cancelling run") })
		signal(t, b, syscall.SIGINT)
		if code := b.wait(t, 30*time.Second); code != 130 {
			t.Fatalf("exit %d, want 130: %s", code, b.stderr)
		}
		id := listRuns(t, ctx, s)[0].GetId()
		requireContains(t, b.stderr.String(), "leasehold: interrupted: run "+id+" cancelled; leasehold runs get "+id+" shows it\n")
		if st := getRun(t, ctx, s, id).GetRun().GetState(); st != controlv1.RunState_RUN_STATE_CANCELLED {
			t.Fatalf("the run is %v, want cancelled", st)
		}
		r := e.run(t, "runs", "cancel", id)
		requireCode(t, r, 0)
		requireContains(t, r.stdout, "run "+id+": cancelled\n")
	})

	t.Run("drain, cordon, cancel", func(t *testing.T) {
		id := createExec(t, ctx, s, "node-2", "sh", "-c", "echo busy; sleep 60")
		eventually(t, 30*time.Second, "the command runs", func() bool {
			r := e.run(t, "logs", id)
			return r.stdout == "busy\n"
		})
		r := e.run(t, "drain", "node-2", "--timeout", "2s", "--reason", "test")
		requireCode(t, r, 1)
		requireContains(t, r.stderr, "node node-2 not drained within 2s (it stays cordoned): commands "+id+"\n")
		r = e.run(t, "cancel", id)
		requireCode(t, r, 0)
		requireContains(t, r.stdout, "command "+id+": cancelled")
		r = e.run(t, "drain", "node-2", "--timeout", "30s")
		requireCode(t, r, 0)
		requireContains(t, r.stdout, "node/node-2 drained")
		r = e.run(t, "nodes", "ls", "--cordoned")
		requireCode(t, r, 0)
		requireContains(t, r.stdout, "node-2")
		requireCode(t, e.run(t, "uncordon", "node-2"), 0)
		requireCode(t, e.run(t, "cordon", "node-1", "--reason", "disk"), 0)
		requireCode(t, e.run(t, "uncordon", "node-1"), 0)
		r = e.run(t, "audit", "--limit", "3", "--method", "UncordonNode")
		requireCode(t, r, 0)
		requireContains(t, r.stdout, "node/node-1")
		r = e.run(t, "audit", "--limit", "5")
		requireCode(t, r, 0)
		golden(t, "audit", normalizeTable(r.stdout))
		r = e.run(t, "audit", "--limit", "5", "-o", "wide")
		requireCode(t, r, 0)
		golden(t, "audit-wide", normalizeTable(r.stdout))
	})

	t.Run("port-forward carries HTTP", func(t *testing.T) {
		b := e.start(t, "port-forward", "node-0", "0:"+itoa(s.webPort))
		var local string
		eventually(t, 30*time.Second, "Forwarding from", func() bool {
			m := regexp.MustCompile(`Forwarding from 127\.0\.0\.1:(\d+) -> node-0:` + itoa(s.webPort)).FindStringSubmatch(b.stdout.String())
			if m != nil {
				local = m[1]
			}
			return m != nil
		})
		for _, path := range []string{"/one", "/two"} {
			res, err := http.Get("http://127.0.0.1:" + local + path)
			if err != nil {
				t.Fatalf("GET through the forward: %v", err)
			}
			body, _ := io.ReadAll(res.Body)
			_ = res.Body.Close()
			if string(body) != "hello from the node's side: "+path+"\n" {
				t.Fatalf("body %q", body)
			}
		}
		signal(t, b, syscall.SIGINT)
		if code := b.wait(t, 30*time.Second); code != 0 {
			t.Fatalf("port-forward exited %d: %s", code, b.stderr)
		}
		// A port outside the node's allowlist: the forward listens, and each
		// connection is refused (and closed) with the daemon's reason.
		b = e.start(t, "port-forward", "node-0", "0:1")
		eventually(t, 30*time.Second, "Forwarding from", func() bool { return strings.HasPrefix(b.stdout.String(), "Forwarding from 127.0.0.1:") })
		local = regexp.MustCompile(`127\.0\.0\.1:(\d+)`).FindStringSubmatch(b.stdout.String())[1]
		c, err := net.Dial("tcp", "127.0.0.1:"+local)
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
		if n, err := c.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
			t.Fatalf("a refused tunnel's connection: read %d, %v; want EOF", n, err)
		}
		_ = c.Close()
		eventually(t, 10*time.Second, "the refusal on stderr", func() bool {
			return strings.Contains(b.stderr.String(), "leasehold: permission_denied: ") && strings.Contains(b.stderr.String(), "allowlist")
		})
		signal(t, b, syscall.SIGINT)
		if code := b.wait(t, 30*time.Second); code != 0 {
			t.Fatalf("port-forward exited %d", code)
		}
	})

	t.Run("tunnel to a node that is not connected", func(t *testing.T) {
		fleettest.RegisterNodes(t, s.db.Pool, "idle", 1)
		r := e.run(t, "shell", "idle-0")
		requireCode(t, r, 1)
		requireContains(t, r.stderr, "leasehold: unavailable: ")
		requireContains(t, r.stderr, "hint: node idle-0 is not connected")
		// run warns, and the command expires unstarted.
		start := time.Now()
		r = e.run(t, "run", "idle-0", "--timeout", "2s", "--", "true")
		requireCode(t, r, 1)
		requireContains(t, r.stderr, "leasehold: warning: node idle-0 is registered: its command waits until it connects, at most 2s\n")
		requireContains(t, r.stderr, "leasehold: idle-0: unreachable")
		t.Logf("expired after %s", time.Since(start))
	})

	t.Run("shell through pipes", func(t *testing.T) {
		r := e.runIn(t, "echo piped-$((6*7))\nexit 4\n", "shell", "node-1")
		requireCode(t, r, 4)
		if r.stdout != "piped-42\n" {
			t.Fatalf("stdout %q", r.stdout)
		}
	})

	t.Run("shell on a pty", func(t *testing.T) {
		cmd := execCommand(e, "shell", "node-0")
		cmd.Env = append(cmd.Env, "TERM=xterm-cli.test")
		ptmx, err := pty.StartWithSize(cmd, &pty.Winsize{Rows: 33, Cols: 101})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = ptmx.Close() }()
		out := &proctest.Buffer{}
		go func() { _, _ = io.Copy(out, ptmx) }()
		_, _ = ptmx.WriteString("stty size; echo \"T=$TERM=\"\n")
		eventually(t, 30*time.Second, "the remote pty has the local size and TERM", func() bool {
			return strings.Contains(out.String(), "33 101\r\n") && strings.Contains(out.String(), "T=xterm-cli.test=")
		})
		if err := pty.Setsize(ptmx, &pty.Winsize{Rows: 40, Cols: 120}); err != nil {
			t.Fatal(err)
		}
		eventually(t, 30*time.Second, "the resize reaches the remote pty", func() bool {
			_, _ = ptmx.WriteString("stty size\n")
			time.Sleep(200 * time.Millisecond) // gives the shell time to answer before the next ask
			return strings.Contains(out.String(), "40 120\r\n")
		})
		_, _ = ptmx.WriteString("exit 7\n")
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			if cmd.ProcessState.ExitCode() != 7 {
				t.Fatalf("exit %v (%v), want 7; output %q", cmd.ProcessState.ExitCode(), err, out.String())
			}
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			t.Fatalf("shell did not end; output %q", out.String())
		}
		t.Logf("pty transcript: %q", out.String())

		// SIGTERM (not a keyboard Ctrl-C, which raw mode hands to the
		// remote shell) ends the tunnel: exit 130.
		cmd = execCommand(e, "shell", "node-0")
		ptmx2, err := pty.StartWithSize(cmd, &pty.Winsize{Rows: 24, Cols: 80})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = ptmx2.Close() }()
		out2 := &proctest.Buffer{}
		go func() { _, _ = io.Copy(out2, ptmx2) }()
		_, _ = ptmx2.WriteString("echo ready-$((1+1))\n")
		eventually(t, 30*time.Second, "the second shell answers", func() bool { return strings.Contains(out2.String(), "ready-2") })
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done2 := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done2) }()
		select {
		case <-done2:
			if c := cmd.ProcessState.ExitCode(); c != 130 {
				t.Fatalf("shell after SIGTERM: exit %d, want 130", c)
			}
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			t.Fatal("shell did not end on SIGTERM")
		}
	})

	t.Run("https api with a CA file", func(t *testing.T) {
		ca := tlstest.NewCA(t)
		certFile, keyFile := tlstest.WriteKeyPair(t, ca.Server(t))
		url := s.startTLSAPI(t, certFile, keyFile)
		requireCode(t, e.run(t, "context", "set", "tls", "--api", url, "--token-env", "LEASEHOLD_TEST_TOKEN", "--ca-file", ca.WriteCA(t)), 0)
		r := e.run(t, "--context", "tls", "nodes", "ls", "-l", "role=db")
		requireCode(t, r, 0)
		requireContains(t, r.stdout, "node-1")
		// A bidi stream (a shell through pipes) over HTTP/2 with TLS.
		r = e.runIn(t, "echo over-tls\nexit 6\n", "--context", "tls", "shell", "node-0")
		requireCode(t, r, 6)
		if r.stdout != "over-tls\n" {
			t.Fatalf("stdout %q", r.stdout)
		}
		// Without the CA the server is not trusted.
		r = e.run(t, "--api", url, "--token-file", writeFile(t, adminToken), "nodes", "ls")
		requireCode(t, r, 1)
		requireContains(t, r.stderr, "certificate")
		requireContains(t, r.stderr, "hint: the api's certificate is not trusted")
	})

	t.Run("a call the api refused as busy is repeated", func(t *testing.T) {
		// One call every two seconds per token: the second invocation
		// is refused at once, with Retry-After.
		url := "http://" + s.startAPI(t, "api_cli_busy", "--api.rate-limit", "0.5", "--api.rate-burst", "1")
		token := writeFile(t, adminToken)
		requireCode(t, e.run(t, "--api", url, "--token-file", token, "nodes", "ls"), 0)
		r := e.run(t, "--api", url, "--token-file", token, "nodes", "ls")
		requireCode(t, r, 0)
		requireContains(t, r.stdout, "node-2")
		requireContains(t, r.stderr, "leasehold: ListNodes: the api is busy (resource_exhausted: rate limit")
		requireContains(t, r.stderr, "trying again in")
		r = e.run(t, "--api", url, "--token-file", token, "--retry-for", "0", "nodes", "ls")
		requireCode(t, r, 1)
		requireContains(t, r.stderr, "--api.rate-limit")
		requireCode(t, e.run(t, "--api", url, "--retry-for", "-1s", "nodes", "ls"), 2)
	})

	t.Run("completion of node ids", func(t *testing.T) {
		r := e.run(t, "__complete", "nodes", "get", "node-")
		requireCode(t, r, 0)
		if !strings.HasPrefix(r.stdout, "node-0\nnode-1\nnode-2\n:4\n") {
			t.Fatalf("node completion: %q", r.stdout)
		}
	})

	t.Run("nodes ls --watch", func(t *testing.T) {
		b := e.start(t, "nodes", "ls", "-l", "role", "--watch", "--watch-interval", "200ms")
		eventually(t, 30*time.Second, "the first list", func() bool { return strings.Count(b.stdout.String(), "\n") == 4 })
		requireCode(t, e.run(t, "cordon", "node-2"), 0)
		eventually(t, 30*time.Second, "a line for the cordoned node", func() bool {
			return regexp.MustCompile(`(?m)^node-2 +connected +yes `).MatchString(b.stdout.String())
		})
		requireCode(t, e.run(t, "uncordon", "node-2"), 0)
		signal(t, b, syscall.SIGINT)
		if code := b.wait(t, 30*time.Second); code != 130 {
			t.Fatalf("watch exited %d, want 130", code)
		}
	})

	t.Run("decommission", func(t *testing.T) {
		r := e.run(t, "decommission", "node-1", "--timeout", "10s")
		requireCode(t, r, 0)
		requireContains(t, r.stdout, "node/node-1 decommissioned")
		r = e.run(t, "nodes", "get", "node-1", "-o", "json")
		requireCode(t, r, 0)
		requireContains(t, r.stdout, `"state": "NODE_STATE_REVOKED"`)
	})
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// linesOf is the lines of out prefixed "node: ", without the prefix.
func linesOf(out, node string) string {
	var b strings.Builder
	for _, l := range strings.SplitAfter(out, "\n") {
		if rest, ok := strings.CutPrefix(l, node+": "); ok {
			b.WriteString(rest)
		}
	}
	return b.String()
}

// listRuns is the newest runs, through the api.
func listRuns(t *testing.T, ctx context.Context, s *stack) []*controlv1.Run {
	t.Helper()
	res, err := s.client.ListRuns(ctx, connect.NewRequest(&controlv1.ListRunsRequest{PageSize: 100}))
	if err != nil {
		t.Fatal(err)
	}
	return res.Msg.GetRuns()
}

// getRun is a run and its nodes, through the api.
func getRun(t *testing.T, ctx context.Context, s *stack, id string) *controlv1.GetRunResponse {
	t.Helper()
	res, err := s.client.GetRun(ctx, connect.NewRequest(&controlv1.GetRunRequest{RunId: id}))
	if err != nil {
		t.Fatal(err)
	}
	return res.Msg
}

func itoa(p uint32) string { return strconv.FormatUint(uint64(p), 10) }

// execCommand is the CLI as an exec.Cmd with the env's environment.
func execCommand(e *cliEnv, args ...string) *exec.Cmd {
	cmd := exec.Command(e.bin, args...)
	cmd.Env = append([]string(nil), e.env...)
	return cmd
}

func writeFile(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(p, []byte(content+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// createExec creates an exec command through the api, as another client
// would.
func createExec(t *testing.T, ctx context.Context, s *stack, node string, argv ...string) string {
	t.Helper()
	payload, err := protojson.Marshal(&nodev1.ExecPayload{Argv: argv})
	if err != nil {
		t.Fatal(err)
	}
	res, err := s.client.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: node, Kind: "exec", Payload: payload}))
	if err != nil {
		t.Fatal(err)
	}
	return res.Msg.GetCommand().GetId()
}
