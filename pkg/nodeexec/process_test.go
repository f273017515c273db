package nodeexec

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func execPayload(t *testing.T, argv ...string) string {
	t.Helper()
	return mustJSON(t, map[string]any{"argv": argv})
}

func TestExecExitCodeAndOutput(t *testing.T) {
	t.Parallel()
	e := newExecutor(t)
	pidFile := filepath.Join(t.TempDir(), "pid")
	o, r := handle(t, e, "exec", execPayload(t, "sh", "-c", `echo out; echo err >&2; echo $$ > "$1"; exit 3`, "sh", pidFile))
	require.Equal(t, int32(3), o.ExitCode)
	require.Empty(t, o.Err)
	require.Equal(t, "out\n", r.stdout.String())
	require.Equal(t, "err\n", r.stderr.String())
	require.Contains(t, string(o.Output), "out\n")
	require.Contains(t, string(o.Output), "err\n")
	pid, err := os.ReadFile(pidFile)
	require.NoError(t, err)
	requireGone(t, strings.TrimSpace(string(pid)))
}

func TestExecEnvDirStdin(t *testing.T) {
	t.Parallel()
	e := newExecutor(t)
	dir := t.TempDir()
	payload := mustJSON(t, map[string]any{
		"argv":  []string{"sh", "-c", `printf '%s|%s|%s|' "$FOO" "$(pwd)" "$LANG"; cat; printf '|%s' "$PATH"`},
		"env":   map[string]string{"FOO": "bar baz", "LANG": "C"},
		"dir":   dir,
		"stdin": []byte("from stdin"),
	})
	o, _ := handle(t, e, "exec", payload)
	require.Equal(t, int32(0), o.ExitCode, o.Err)
	require.Empty(t, o.Err)
	fields := strings.Split(string(o.Output), "|")
	require.Len(t, fields, 5, string(o.Output))
	require.Equal(t, "bar baz", fields[0])
	require.Equal(t, dir, fields[1])
	require.Equal(t, "C", fields[2], "the payload's env wins over the base")
	require.Equal(t, "from stdin", fields[3])
	require.NotEmpty(t, fields[4], "PATH is in the base environment")
}

// TestExecBaseEnvironment: a command sees the small base environment, not
// the agent's.
func TestExecBaseEnvironment(t *testing.T) {
	t.Parallel()
	e := newExecutor(t)
	o, _ := handle(t, e, "exec", execPayload(t, "env"))
	require.Equal(t, int32(0), o.ExitCode, o.Err)
	var names []string
	for line := range strings.Lines(string(o.Output)) {
		k, _, _ := strings.Cut(line, "=")
		names = append(names, k)
	}
	require.ElementsMatch(t, []string{"PATH", "LANG", "HOME", "USER", "LOGNAME"}, names, string(o.Output))
}

// TestExecStreamsWhileRunning: output is seen live while the command still
// runs; the command waits for the test to have seen it.
func TestExecStreamsWhileRunning(t *testing.T) {
	t.Parallel()
	e := newExecutor(t)
	flag := filepath.Join(t.TempDir(), "go-on")
	r := start(t, e, "exec", execPayload(t, "sh", "-c", `echo first; echo first-err >&2; while [ ! -e "$1" ]; do sleep 0.02; done; echo second`, "sh", flag))
	r.waitOutput(t, "first\n")
	require.Eventually(t, func() bool { return r.stderr.String() == "first-err\n" }, 10*time.Second, 5*time.Millisecond)
	select {
	case o := <-r.done:
		t.Fatalf("the command ended before it was let go: %+v", o)
	default:
	}
	require.NoError(t, os.WriteFile(flag, nil, 0o600))
	o := r.wait(t)
	require.Equal(t, int32(0), o.ExitCode, o.Err)
	require.Equal(t, "first\nsecond\n", r.stdout.String())
}

// TestExecCancelStopsTheGroup: a cancel stops the main process and its
// background child with SIGTERM; no process and no zombie is left.
func TestExecCancelStopsTheGroup(t *testing.T) {
	t.Parallel()
	e := newExecutor(t)
	m := marker()
	r := start(t, e, "exec", execPayload(t, "sh", "-c", "sleep "+m+" & echo started $$ $!; sleep "+m))
	r.waitOutput(t, "\n")
	require.GreaterOrEqual(t, len(processesWith(t, m)), 2, "the shell and its background sleep run")
	began := time.Now()
	r.cancel()
	o := r.wait(t)
	require.Less(t, time.Since(began), 5*time.Second, "SIGTERM ends it well within the grace")
	require.Equal(t, int32(128+15), o.ExitCode)
	require.Equal(t, "terminated by SIGTERM (cancelled)", o.Err)
	requireNoneLeft(t, m)
	requireGone(t, strings.Fields(r.stdout.String())[1:]...)
}

// TestExecCancelKillsAfterGrace: a group that ignores SIGTERM is killed
// with SIGKILL after the grace.
func TestExecCancelKillsAfterGrace(t *testing.T) {
	t.Parallel()
	e := newExecutor(t, func(c *Config) { c.KillGrace = 300 * time.Millisecond })
	m := marker()
	r := start(t, e, "exec", execPayload(t, "sh", "-c", "trap '' TERM; sleep "+m+" & echo started $$ $!; sleep "+m))
	r.waitOutput(t, "\n")
	r.cancel()
	o := r.wait(t)
	require.Equal(t, int32(128+9), o.ExitCode)
	require.Equal(t, "killed by SIGKILL after the 300ms grace (cancelled)", o.Err)
	requireNoneLeft(t, m)
	requireGone(t, strings.Fields(r.stdout.String())[1:]...)
}

// TestExecLeftoverChildStopped: a command that exits leaving a background
// child holding its output pipe returns at once, and the child is stopped
// (SIGTERM; SIGKILL after the grace for one that ignores SIGTERM).
func TestExecLeftoverChildStopped(t *testing.T) {
	t.Parallel()
	e := newExecutor(t, func(c *Config) { c.KillGrace = 300 * time.Millisecond })
	m1, m2 := marker(), marker()
	began := time.Now()
	o, r := handle(t, e, "exec", execPayload(t, "sh", "-c", "sleep "+m1+" & a=$!; (trap '' TERM; sleep "+m2+") & echo started $$ $a $!"))
	require.Less(t, time.Since(began), 10*time.Second)
	require.Equal(t, int32(0), o.ExitCode, o.Err)
	require.Empty(t, o.Err)
	out := strings.Fields(r.stdout.String())
	require.Len(t, out, 4, r.stdout.String())
	require.Equal(t, "started", out[0])
	requireNoneLeft(t, m1)
	requireNoneLeft(t, m2)
	requireGone(t, out[1:]...)
}

func TestExecTimeout(t *testing.T) {
	t.Parallel()
	e := newExecutor(t, func(c *Config) { c.KillGrace = 300 * time.Millisecond })
	m := marker()
	o, _ := handle(t, e, "exec", mustJSON(t, map[string]any{"argv": []string{"sleep", m}, "timeout": "0.4s"}))
	require.Equal(t, int32(128+15), o.ExitCode)
	require.Equal(t, "timed out after 400ms (terminated by SIGTERM)", o.Err)

	o, _ = handle(t, e, "exec", mustJSON(t, map[string]any{"argv": []string{"sh", "-c", "trap '' TERM; sleep " + m}, "timeout": "0.2s"}))
	require.Equal(t, int32(128+9), o.ExitCode)
	require.Equal(t, "timed out after 200ms (killed by SIGKILL after the 300ms grace)", o.Err)
	requireNoneLeft(t, m)
}

// TestExecDeadline: the command's deadline bounds a run without a timeout
// of its own.
func TestExecDeadline(t *testing.T) {
	t.Parallel()
	e := newExecutor(t)
	m := marker()
	r := start(t, e, "exec", execPayload(t, "sleep", m), time.Now().Add(300*time.Millisecond))
	o := r.wait(t)
	require.Equal(t, int32(128+15), o.ExitCode)
	require.True(t, strings.HasPrefix(o.Err, "timed out at the command's deadline after "), o.Err)
	require.True(t, strings.HasSuffix(o.Err, " (terminated by SIGTERM)"), o.Err)
	requireNoneLeft(t, m)
}

func TestExecSignalExit(t *testing.T) {
	t.Parallel()
	e := newExecutor(t)
	o, _ := handle(t, e, "exec", execPayload(t, "sh", "-c", "kill -USR1 $$"))
	require.Equal(t, int32(128+10), o.ExitCode)
	require.Equal(t, "terminated by SIGUSR1", o.Err)
}

// TestExecOutputTail: the result keeps the last ResultTailBytes after a
// marker line counting what it left out; the live output has everything.
func TestExecOutputTail(t *testing.T) {
	t.Parallel()
	e := newExecutor(t)
	const n = 200_000
	o, r := handle(t, e, "exec", execPayload(t, "sh", "-c", "head -c 199999 /dev/zero | tr '\\0' a; printf z"))
	require.Equal(t, int32(0), o.ExitCode, o.Err)
	require.Len(t, r.stdout.Bytes(), n)
	marker, tail, ok := strings.Cut(string(o.Output), "\n")
	require.True(t, ok)
	require.Equal(t, "[leasehold: 134464 earlier bytes not kept in the result; the full output is in the command's live output]", marker)
	require.Len(t, tail, ResultTailBytes)
	require.Equal(t, strings.Repeat("a", ResultTailBytes-1)+"z", tail)

	// Output within the tail has no marker.
	o, _ = handle(t, e, "exec", execPayload(t, "sh", "-c", "head -c 65536 /dev/zero"))
	require.Len(t, o.Output, ResultTailBytes)
}

func TestExecStartErrors(t *testing.T) {
	t.Parallel()
	e := newExecutor(t)
	o, _ := handle(t, e, "exec", execPayload(t, "no-such-program-leasehold"))
	require.Equal(t, int32(-1), o.ExitCode)
	require.True(t, strings.HasPrefix(o.Err, "not_found: "), o.Err)

	o, _ = handle(t, e, "exec", mustJSON(t, map[string]any{"argv": []string{"true"}, "dir": "/no/such/dir"}))
	require.Equal(t, int32(-1), o.ExitCode)
	require.Equal(t, "not_found: dir /no/such/dir is not a directory on this node", o.Err)

	o, _ = handle(t, e, "exec", mustJSON(t, map[string]any{"argv": []string{"true"}, "user": "no-such-user-leasehold"}))
	require.Equal(t, int32(-1), o.ExitCode)
	require.True(t, strings.HasPrefix(o.Err, `user_not_found: user "no-such-user-leasehold"`), o.Err)

	o, _ = handle(t, e, "exec", mustJSON(t, map[string]any{"argv": []string{"true"}, "group": "no-such-group-leasehold"}))
	require.Equal(t, int32(-1), o.ExitCode)
	require.True(t, strings.HasPrefix(o.Err, `group_not_found: group "no-such-group-leasehold"`), o.Err)
}

// TestExecAsUser: as root the command runs as the named user, with its
// home and name in the environment; as anyone else that is refused,
// saying root is needed.
func TestExecAsUser(t *testing.T) {
	t.Parallel()
	e := newExecutor(t)
	o, _ := handle(t, e, "exec", mustJSON(t, map[string]any{"argv": []string{"sh", "-c", `echo "$(id -u):$(id -g):$USER"`}, "user": "nobody", "dir": "/"}))
	if os.Geteuid() != 0 {
		require.Equal(t, int32(-1), o.ExitCode)
		require.True(t, strings.HasPrefix(o.Err, "permission_denied: running as user \"nobody\""), o.Err)
		require.Contains(t, o.Err, "needs leasehold-node to run as root")
		return
	}
	require.Equal(t, int32(0), o.ExitCode, o.Err)
	id, err := lookupUser("nobody")
	require.NoError(t, err)
	require.Equal(t, strings.Join([]string{itoa(id.uid), itoa(id.gid), "nobody"}, ":")+"\n", string(o.Output))
}

func itoa(v uint32) string { return strconv.FormatUint(uint64(v), 10) }

// TestScript: the script runs from a private directory with its
// interpreter and arguments; the directory is gone afterwards.
func TestScript(t *testing.T) {
	t.Parallel()
	e := newExecutor(t)
	o, _ := handle(t, e, "script", mustJSON(t, map[string]any{"interpreter": "sh",
		"script": "printf '%s|%s|' \"$0\" \"$1\"; stat -c %a \"$(dirname \"$0\")\" \"$0\"\nexit 4\n", "args": []string{"arg one"}}))
	require.Equal(t, int32(4), o.ExitCode, o.Err)
	fields := strings.SplitN(string(o.Output), "|", 3)
	require.Len(t, fields, 3, string(o.Output))
	require.Equal(t, "arg one", fields[1])
	require.Equal(t, "700\n700\n", fields[2], "private directory and file")
	require.NoFileExists(t, fields[0])
	require.NoDirExists(t, filepath.Dir(fields[0]))

	if os.Geteuid() == 0 {
		// As another user the private directory is that user's.
		o, _ = handle(t, e, "script", mustJSON(t, map[string]any{"interpreter": "/bin/sh", "user": "nobody",
			"script": "id -un; stat -c %U \"$(dirname \"$0\")\" \"$0\""}))
		require.Equal(t, int32(0), o.ExitCode, o.Err)
		require.Equal(t, "nobody\nnobody\nnobody\n", string(o.Output))
	}

	o, _ = handle(t, e, "script", mustJSON(t, map[string]any{"interpreter": "no-such-interpreter-leasehold", "script": "x"}))
	require.Equal(t, int32(-1), o.ExitCode)
	require.True(t, strings.HasPrefix(o.Err, "not_found: "), o.Err)
}

// TestConcurrencyLimit: at most MaxConcurrent commands run at once, as the
// commands themselves count; the others wait and then run.
func TestConcurrencyLimit(t *testing.T) {
	t.Parallel()
	e := newExecutor(t, func(c *Config) { c.MaxConcurrent = 2 })
	dir := t.TempDir()
	// Each command registers itself, counts who is running, and leaves.
	script := `touch "$1/run.$$"; ls "$1" | grep -c '^run\.' >> "$1/counts"; sleep 0.5; rm "$1/run.$$"`
	var runs []*run
	for range 6 {
		runs = append(runs, start(t, e, "exec", execPayload(t, "sh", "-c", script, "sh", dir)))
	}
	for _, r := range runs {
		o := r.wait(t)
		require.Equal(t, int32(0), o.ExitCode, o.Err)
	}
	b, err := os.ReadFile(filepath.Join(dir, "counts"))
	require.NoError(t, err)
	counts := strings.Fields(string(b))
	require.Len(t, counts, 6)
	require.NotContains(t, counts, "3", "more than 2 ran at once: %v", counts)
	require.Contains(t, counts, "2", "two ran at once: %v", counts)
}

// TestCancelWhileQueued: a command waiting for a slot is cancelled at once
// and never runs.
func TestCancelWhileQueued(t *testing.T) {
	t.Parallel()
	e := newExecutor(t, func(c *Config) { c.MaxConcurrent = 1 })
	m := marker()
	first := start(t, e, "exec", execPayload(t, "sh", "-c", "echo started; sleep "+m))
	first.waitOutput(t, "started")
	ran := filepath.Join(t.TempDir(), "ran")
	queued := start(t, e, "exec", execPayload(t, "touch", ran))
	select {
	case o := <-queued.done:
		t.Fatalf("the queued command ended while the slot was taken: %+v", o)
	case <-time.After(100 * time.Millisecond):
	}
	queued.cancel()
	o := queued.wait(t)
	require.Equal(t, int32(-1), o.ExitCode)
	require.Equal(t, "cancelled before it started", o.Err)
	// One whose deadline passes while it waits ends then.
	late := start(t, e, "exec", execPayload(t, "touch", ran), time.Now().Add(200*time.Millisecond))
	o = late.wait(t)
	require.Equal(t, int32(-1), o.ExitCode)
	require.Equal(t, "deadline passed before it started (waiting for one of the 1 running commands to end)", o.Err)
	first.cancel()
	first.wait(t)
	require.NoFileExists(t, ran)
	requireNoneLeft(t, m)
}
