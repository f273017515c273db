// Package proctest runs leasehold binaries as real OS processes in tests:
// build once per test binary, start with flags and environment, wait for
// /readyz, pause (SIGSTOP), resume, terminate (SIGTERM) or kill (SIGKILL),
// and read what they logged.
package proctest

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

var (
	buildMu sync.Mutex
	built   = map[string]string{}
	binDir  string
)

// Build compiles the main package in dir (a path relative to the test's
// working directory, or absolute) once per test binary and returns the
// binary's path. Under go test -race the binary is built with -race too.
func Build(t testing.TB, dir string) string {
	t.Helper()
	abs, err := filepath.Abs(dir)
	if err != nil {
		t.Fatalf("proctest: %v", err)
	}
	buildMu.Lock()
	defer buildMu.Unlock()
	if p, ok := built[abs]; ok {
		return p
	}
	if binDir == "" {
		if binDir, err = os.MkdirTemp("", "leasehold-proctest-"); err != nil {
			t.Fatalf("proctest: %v", err)
		}
	}
	out := filepath.Join(binDir, filepath.Base(abs))
	args := []string{"build", "-o", out}
	if raceEnabled {
		args = append(args, "-race")
	}
	cmd := exec.Command("go", append(args, ".")...)
	cmd.Dir = abs
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("proctest: go build %s: %v\n%s", abs, err, b)
	}
	built[abs] = out
	return out
}

// raceReport starts every report of the race detector (a binary built with
// -race writes it to stderr and carries on).
const raceReport = "WARNING: DATA RACE"

// Proc is a running process.
type Proc struct {
	t    testing.TB
	Name string
	Cmd  *exec.Cmd
	// HTTPAddr is the health address given with --http-addr, if any.
	HTTPAddr string
	logs     *Buffer
	done     chan struct{}
	waitErr  error
}

// Buffer collects a process's or logger's output while a test reads it: a
// bytes.Buffer safe for one writer and concurrent readers.
type Buffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Start runs bin with args and extra environment. The process is killed
// when the test ends if it is still running; its output is logged on failure.
func Start(t testing.TB, name, bin string, env []string, args ...string) *Proc {
	t.Helper()
	p := &Proc{t: t, Name: name, logs: &Buffer{}, done: make(chan struct{})}
	for i, a := range args {
		if a == "--http-addr" && i+1 < len(args) {
			p.HTTPAddr = args[i+1]
		}
	}
	p.Cmd = exec.Command(bin, args...)
	p.Cmd.Env = append(os.Environ(), env...)
	p.Cmd.Stdout, p.Cmd.Stderr = p.logs, p.logs
	if err := p.Cmd.Start(); err != nil {
		t.Fatalf("proctest: start %s: %v", name, err)
	}
	go func() {
		p.waitErr = p.Cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = p.Cmd.Process.Signal(syscall.SIGCONT)
		_ = p.Cmd.Process.Kill()
		<-p.done
		if strings.Contains(p.Logs(), raceReport) {
			t.Errorf("%s: the race detector reported a data race", name)
		}
		if t.Failed() {
			t.Logf("--- output of %s ---\n%s", name, p.Logs())
		}
	})
	return p
}

// Logs returns everything the process wrote so far.
func (p *Proc) Logs() string { return p.logs.String() }

// WaitReady polls /readyz until it answers 200.
func (p *Proc) WaitReady(timeout time.Duration) {
	p.t.Helper()
	p.waitStatus("/readyz", http.StatusOK, timeout)
}

func (p *Proc) waitStatus(path string, want int, timeout time.Duration) {
	p.t.Helper()
	deadline := time.Now().Add(timeout)
	var last string
	for time.Now().Before(deadline) {
		select {
		case <-p.done:
			p.t.Fatalf("%s exited while waiting for %s: %v\n%s", p.Name, path, p.waitErr, p.Logs())
		default:
		}
		code, body, err := p.Get(path, "")
		if err == nil && code == want {
			return
		}
		last = fmt.Sprintf("%d %s %v", code, strings.TrimSpace(body), err)
		time.Sleep(50 * time.Millisecond)
	}
	p.t.Fatalf("%s: %s did not answer %d within %s (last: %s)\n%s", p.Name, path, want, timeout, last, p.Logs())
}

// Get fetches path from the health server with an optional bearer token.
func (p *Proc) Get(path, token string) (int, string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+p.HTTPAddr+path, nil)
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

// Signal sends sig to the process.
func (p *Proc) Signal(sig syscall.Signal) {
	p.t.Helper()
	if err := p.Cmd.Process.Signal(sig); err != nil {
		p.t.Fatalf("proctest: signal %s to %s: %v", sig, p.Name, err)
	}
}

// Pause stops the process with SIGSTOP; Resume continues it.
func (p *Proc) Pause()  { p.Signal(syscall.SIGSTOP) }
func (p *Proc) Resume() { p.Signal(syscall.SIGCONT) }

// Kill sends SIGKILL and waits for the exit.
func (p *Proc) Kill() {
	p.Signal(syscall.SIGKILL)
	<-p.done
}

// Wait waits up to timeout for the process to exit and returns its exit code.
func (p *Proc) Wait(timeout time.Duration) int {
	p.t.Helper()
	select {
	case <-p.done:
	case <-time.After(timeout):
		p.t.Fatalf("%s did not exit within %s\n%s", p.Name, timeout, p.Logs())
	}
	if p.Cmd.ProcessState == nil {
		return -1
	}
	return p.Cmd.ProcessState.ExitCode()
}

// Exited reports whether the process has exited.
func (p *Proc) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}
