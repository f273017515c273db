package nodeexec

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/leasehold/leasehold/pkg/daemon"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/proctest"
)

// run is one Handle call with its live output.
type run struct {
	stdout, stderr proctest.Buffer
	done           chan daemon.Outcome
	cancel         context.CancelFunc
}

// start runs a command on e in the background.
func start(t *testing.T, e *Executor, kind, payload string, deadline ...time.Time) *run {
	t.Helper()
	r := &run{done: make(chan daemon.Outcome, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	t.Cleanup(cancel)
	ctx = daemon.WithOutput(ctx, &r.stdout, &r.stderr)
	cmd := &nodev1.Command{CommandId: fmt.Sprintf("c-%d", rand.Int64()), Kind: kind, Payload: []byte(payload)}
	if len(deadline) > 0 {
		cmd.Deadline = timestamppb.New(deadline[0])
	}
	go func() { r.done <- e.Handle(ctx, cmd) }()
	return r
}

// wait is the command's Outcome, failing the test after 30 s.
func (r *run) wait(t *testing.T) daemon.Outcome {
	t.Helper()
	select {
	case o := <-r.done:
		return o
	case <-time.After(30 * time.Second):
		t.Fatal("the command did not end within 30 s")
		return daemon.Outcome{}
	}
}

// waitOutput waits until the live stdout contains s.
func (r *run) waitOutput(t *testing.T, s string) {
	t.Helper()
	require.Eventually(t, func() bool { return strings.Contains(r.stdout.String(), s) }, 20*time.Second, 5*time.Millisecond,
		"stdout %q never contained %q", r.stdout.String(), s)
}

func handle(t *testing.T, e *Executor, kind, payload string) (daemon.Outcome, *run) {
	t.Helper()
	r := start(t, e, kind, payload)
	return r.wait(t), r
}

func newExecutor(t *testing.T, mutate ...func(*Config)) *Executor {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Version = "test-version"
	// The process-group behaviour; cgroup_linux_test.go runs commands in
	// cgroups of their own.
	cfg.Cgroup = CgroupOff
	for _, m := range mutate {
		m(&cfg)
	}
	e, err := New(cfg, nil)
	require.NoError(t, err)
	t.Cleanup(e.Close)
	return e
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return string(b)
}

// marker is a unique sleep duration, so the test's processes can be found
// in /proc by their command line.
func marker() string { return fmt.Sprintf("%d.%06d", 7000+rand.IntN(1000), rand.IntN(1_000_000)) }

// processesWith lists the live processes whose command line contains s.
func processesWith(t *testing.T, s string) []string {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	require.NoError(t, err)
	var out []string
	for _, ent := range entries {
		pid, err := strconv.Atoi(ent.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + ent.Name() + "/cmdline")
		if err != nil || !bytes.Contains(b, []byte(s)) {
			continue
		}
		if state, _, _, ok := procStat(pid); ok && state != 'Z' {
			out = append(out, fmt.Sprintf("%d %q", pid, bytes.ReplaceAll(b, []byte{0}, []byte{' '})))
		}
	}
	return out
}

// requireGone requires that none of pids is alive or left unreaped by
// this process: Handle reaps its command's main process and stops its
// group before it returns. (An orphan reparented to init is init's to
// reap.)
func requireGone(t *testing.T, pids ...string) {
	t.Helper()
	require.NotEmpty(t, pids)
	for _, s := range pids {
		pid, err := strconv.Atoi(s)
		require.NoError(t, err, "pid %q", s)
		state, ppid, _, ok := procStat(pid)
		if !ok {
			continue // gone and reaped
		}
		require.Equal(t, byte('Z'), state, "process %d is still alive (state %c)", pid, state)
		require.NotEqual(t, os.Getpid(), ppid, "process %d is a zombie child of this process", pid)
	}
}

// requireNoneLeft requires that no process with s in its command line is
// alive: Handle returns only once its command's group is gone.
func requireNoneLeft(t *testing.T, s string) {
	t.Helper()
	require.Empty(t, processesWith(t, s), "processes left")
}
