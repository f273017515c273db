// Package proctest runs leasehold binaries as real OS processes in tests:
// build once per test binary, start with flags and environment, wait for
// /readyz, pause (SIGSTOP), resume, terminate (SIGTERM) or kill (SIGKILL),
// and read what they logged.
package proctest

import (
	"bytes"
	"context"
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

// RemoveBuilt removes every binary Build made, and the directory that
// held them; a later Build builds again. The Main functions of the test
// packages (pgtest.Main, leakcheck.Main) call it once the tests are over:
// without it each run of a test binary left its binaries, a quarter of a
// gigabyte for the services, in the temporary directory.
func RemoveBuilt() {
	buildMu.Lock()
	defer buildMu.Unlock()
	if binDir != "" {
		_ = os.RemoveAll(binDir)
	}
	binDir, built = "", map[string]string{}
}

// raceReport starts every report of the race detector (a binary built with
// -race writes it to stderr and carries on).
const raceReport = "WARNING: DATA RACE"

// Proc is a running process under a test: a Child whose failures fail the
// test, killed when the test ends.
type Proc struct {
	*Child
	t    testing.TB
	logs *Buffer
}

// Buffer collects a process's or logger's output while a test reads it: a
// bytes.Buffer safe for one writer and concurrent readers. With Max set it
// keeps only the last Max bytes.
type Buffer struct {
	// Max bounds what is kept (0: everything).
	Max int

	mu  sync.Mutex
	buf bytes.Buffer
}

// Write appends p, dropping the oldest bytes beyond Max.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	n, err := b.buf.Write(p)
	if over := b.buf.Len() - b.Max; b.Max > 0 && over > 0 {
		b.buf.Next(over)
	}
	return n, err
}

// String returns what is kept.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Bytes returns a copy of what is kept.
func (b *Buffer) Bytes() []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	return bytes.Clone(b.buf.Bytes())
}

// Start runs bin with args and extra environment. The process is killed
// when the test ends if it is still running; its output is logged on failure.
func Start(t testing.TB, name, bin string, env []string, args ...string) *Proc {
	t.Helper()
	logs := &Buffer{}
	c, err := StartChild(name, bin, args, ChildOptions{Env: env, Output: logs})
	if err != nil {
		t.Fatalf("proctest: %v", err)
	}
	p := &Proc{Child: c, t: t, logs: logs}
	t.Cleanup(func() {
		_ = c.Cmd.Process.Signal(syscall.SIGCONT)
		_ = c.Cmd.Process.Kill()
		<-c.Done()
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
	if err := p.AwaitStatus(context.Background(), "/readyz", http.StatusOK, timeout); err != nil {
		p.t.Fatalf("%v\n%s", err, p.Logs())
	}
}

// Get fetches path from the health server with an optional bearer token.
func (p *Proc) Get(path, token string) (int, string, error) {
	return p.Fetch(context.Background(), path, token)
}

// Signal sends sig to the process.
func (p *Proc) Signal(sig syscall.Signal) {
	p.t.Helper()
	if err := p.SendSignal(sig); err != nil {
		p.t.Fatalf("proctest: %v", err)
	}
}

// Pause stops the process with SIGSTOP; Resume continues it.
func (p *Proc) Pause()  { p.Signal(syscall.SIGSTOP) }
func (p *Proc) Resume() { p.Signal(syscall.SIGCONT) }

// Kill sends SIGKILL and waits for the exit.
func (p *Proc) Kill() {
	p.Signal(syscall.SIGKILL)
	<-p.Done()
}

// Wait waits up to timeout for the process to exit and returns its exit code.
func (p *Proc) Wait(timeout time.Duration) int {
	p.t.Helper()
	code, ok := p.WaitExit(timeout)
	if !ok {
		p.t.Fatalf("%s did not exit within %s\n%s", p.Name, timeout, p.Logs())
	}
	return code
}
