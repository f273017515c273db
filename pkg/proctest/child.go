package proctest

// The process core shared by the tests' Proc and the benches' supervisor
// (bench/internal/harness): start a binary, learn its health address, send
// it signals, wait for its exit and poll its health endpoints. It needs no
// testing.TB, so a bench's main can use it too.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
	"time"
)

// ChildOptions says how StartChild runs a process.
type ChildOptions struct {
	// Env is added to the parent's environment.
	Env []string
	// Output receives stdout and stderr.
	Output io.Writer
	// Stdout, if set, also receives stdout (e.g. a line parser).
	Stdout io.Writer
	// OwnGroup puts the process in a process group of its own and kills it
	// with SIGKILL should the parent die (Pdeathsig), so a bench's children
	// never outlive it.
	OwnGroup bool
	// OnExit, if set, runs after the exit, once the output is copied.
	OnExit func()
}

// Child is a running process.
type Child struct {
	// Name names the process in messages.
	Name string
	// Cmd is the started command.
	Cmd *exec.Cmd
	// HTTPAddr is the value of --http-addr (or -http-addr), if given.
	HTTPAddr string

	done    chan struct{}
	waitErr error
}

// StartChild runs bin with args. The caller ends it (Kill) when done.
func StartChild(name, bin string, args []string, opts ChildOptions) (*Child, error) {
	c := &Child{Name: name, done: make(chan struct{})}
	for i, a := range args {
		if (a == "--http-addr" || a == "-http-addr") && i+1 < len(args) {
			c.HTTPAddr = args[i+1]
		}
	}
	c.Cmd = exec.Command(bin, args...)
	c.Cmd.Env = append(os.Environ(), opts.Env...)
	c.Cmd.Stdout, c.Cmd.Stderr = opts.Output, opts.Output
	if opts.Stdout != nil {
		c.Cmd.Stdout = io.MultiWriter(opts.Output, opts.Stdout)
	}
	if opts.OwnGroup {
		c.Cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		// Pdeathsig fires when the thread that forked exits: keep it alive.
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
	}
	if err := c.Cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	go func() {
		c.waitErr = c.Cmd.Wait() // also waits for the output copies
		if opts.OnExit != nil {
			opts.OnExit()
		}
		close(c.done)
	}()
	return c, nil
}

// Done is closed when the process has exited.
func (c *Child) Done() <-chan struct{} { return c.done }

// Exited reports whether the process has exited.
func (c *Child) Exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// ExitErr is what waiting for the process returned (nil before the exit).
func (c *Child) ExitErr() error {
	if !c.Exited() {
		return nil
	}
	return c.waitErr
}

// ExitCode is the exit code once exited (-1 for a signal or still running).
func (c *Child) ExitCode() int {
	if !c.Exited() || c.Cmd.ProcessState == nil {
		return -1
	}
	return c.Cmd.ProcessState.ExitCode()
}

// WaitExit waits up to timeout for the exit; it returns the exit code and
// whether the process exited.
func (c *Child) WaitExit(timeout time.Duration) (int, bool) {
	select {
	case <-c.done:
		return c.ExitCode(), true
	case <-time.After(timeout):
		return -1, false
	}
}

// SendSignal sends sig to the process.
func (c *Child) SendSignal(sig syscall.Signal) error {
	if err := c.Cmd.Process.Signal(sig); err != nil {
		return fmt.Errorf("signal %s to %s: %w", sig, c.Name, err)
	}
	return nil
}

// KillGroup sends SIGCONT (so a paused process dies too) and SIGKILL to the
// process, or to its whole group when it runs in one of its own; it does
// not wait.
func (c *Child) KillGroup() {
	pid := c.Cmd.Process.Pid
	if c.Cmd.SysProcAttr != nil && c.Cmd.SysProcAttr.Setpgid {
		pid = -pid
	}
	_ = syscall.Kill(pid, syscall.SIGCONT)
	_ = syscall.Kill(pid, syscall.SIGKILL)
}

// Fetch gets path from the process's health address, with a bearer token
// when token is not empty, and returns the status and body.
func (c *Child) Fetch(ctx context.Context, path, token string) (int, string, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+c.HTTPAddr+path, nil)
	if err != nil {
		return 0, "", err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	var b bytes.Buffer
	_, _ = b.ReadFrom(resp.Body)
	return resp.StatusCode, b.String(), nil
}

// errExited is returned by AwaitStatus when the process exits first.
var errExited = errors.New("exited")

// AwaitStatus polls path every 50 ms until it answers want, the process
// exits, ctx ends or timeout passes; the error says which, with the last
// answer seen.
func (c *Child) AwaitStatus(ctx context.Context, path string, want int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last string
	for {
		if c.Exited() {
			// The exit status is described, not wrapped: it may be nil (a
			// clean exit), and callers match errExited.
			return fmt.Errorf("%s %w (%s) while waiting for %s", c.Name, errExited, fmt.Sprint(c.waitErr), path)
		}
		code, body, err := c.Fetch(ctx, path, "")
		if err == nil && code == want {
			return nil
		}
		last = fmt.Sprintf("%d %s %v", code, strings.TrimSpace(body), err)
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: %s did not answer %d within %s (last: %s)", c.Name, path, want, timeout, last)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}
