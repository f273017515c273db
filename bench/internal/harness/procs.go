// Package harness runs the real leasehold services as child processes for
// the benches: it builds them, starts PostgreSQL and HAProxy, registers
// nodes, and makes sure every child dies with the bench (SIGKILL on exit,
// SIGINT or SIGTERM included, and Pdeathsig should the bench itself be
// killed).
package harness

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"sync"
	"syscall"
	"time"
)

// Supervisor owns child processes and kills them all on Stop.
type Supervisor struct {
	// LogDir receives one <name>.log per process (stdout and stderr).
	LogDir string

	mu    sync.Mutex
	procs []*Proc
}

// Proc is a running child process.
type Proc struct {
	Name string
	Cmd  *exec.Cmd
	// HTTPAddr is the value of --http-addr, if given.
	HTTPAddr string
	LogPath  string

	done    chan struct{}
	waitErr error
	tail    *tailBuffer
}

// Start runs bin with args in its own process group. It dies with the bench.
func (s *Supervisor) Start(name, bin string, env []string, args ...string) (*Proc, error) {
	return s.StartLines(name, bin, env, nil, args...)
}

// StartLines is Start with onLine called for every line the process
// writes to stdout, as it is written.
func (s *Supervisor) StartLines(name, bin string, env []string, onLine func(string), args ...string) (*Proc, error) {
	p := &Proc{Name: name, done: make(chan struct{}), tail: &tailBuffer{max: 32 << 10}}
	for i, a := range args {
		if (a == "--http-addr" || a == "-http-addr") && i+1 < len(args) {
			p.HTTPAddr = args[i+1]
		}
	}
	var out io.Writer = p.tail
	var logFile *os.File
	if s.LogDir != "" {
		p.LogPath = filepath.Join(s.LogDir, name+".log")
		f, err := os.Create(p.LogPath)
		if err != nil {
			return nil, err
		}
		logFile = f
		out = io.MultiWriter(f, p.tail)
	}
	p.Cmd = exec.Command(bin, args...)
	p.Cmd.Env = append(os.Environ(), env...)
	p.Cmd.Stdout, p.Cmd.Stderr = out, out
	if onLine != nil {
		p.Cmd.Stdout = io.MultiWriter(out, &lineWriter{fn: onLine})
	}
	p.Cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	// Pdeathsig fires when the thread that forked exits: keep it alive.
	runtime.LockOSThread()
	err := p.Cmd.Start()
	runtime.UnlockOSThread()
	if err != nil {
		if logFile != nil {
			logFile.Close()
		}
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	go func() {
		p.waitErr = p.Cmd.Wait() // also waits for the output copies
		if logFile != nil {
			logFile.Close()
		}
		close(p.done)
	}()
	s.mu.Lock()
	s.procs = append(s.procs, p)
	s.mu.Unlock()
	return p, nil
}

// Stop kills every process still running (SIGCONT first, so a paused one
// dies too) and waits for them.
func (s *Supervisor) Stop() {
	s.mu.Lock()
	procs := s.procs
	s.procs = nil
	s.mu.Unlock()
	for _, p := range procs {
		if !p.Exited() {
			_ = syscall.Kill(-p.Cmd.Process.Pid, syscall.SIGCONT)
			_ = syscall.Kill(-p.Cmd.Process.Pid, syscall.SIGKILL)
		}
	}
	for _, p := range procs {
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
		}
	}
}

// Signal sends sig to the process.
func (p *Proc) Signal(sig syscall.Signal) error {
	if err := p.Cmd.Process.Signal(sig); err != nil {
		return fmt.Errorf("signal %s to %s: %w", sig, p.Name, err)
	}
	return nil
}

// Kill sends SIGKILL and waits for the exit.
func (p *Proc) Kill() {
	_ = p.Cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
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

// Done is closed when the process has exited.
func (p *Proc) Done() <-chan struct{} { return p.done }

// ExitCode is the exit code once exited (-1 for a signal or still running).
func (p *Proc) ExitCode() int {
	if !p.Exited() || p.Cmd.ProcessState == nil {
		return -1
	}
	return p.Cmd.ProcessState.ExitCode()
}

// Wait waits up to timeout for the exit and returns the exit code.
func (p *Proc) Wait(timeout time.Duration) (int, bool) {
	select {
	case <-p.done:
		return p.ExitCode(), true
	case <-time.After(timeout):
		return -1, false
	}
}

// Tail returns the last output of the process.
func (p *Proc) Tail() string { return p.tail.String() }

// Get fetches path from the process's --http-addr.
func (p *Proc) Get(ctx context.Context, path string) (int, string, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+p.HTTPAddr+path, nil)
	if err != nil {
		return 0, "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), nil
}

// WaitReady polls /readyz until it answers 200.
func (p *Proc) WaitReady(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		if p.Exited() {
			return fmt.Errorf("%s exited (%w) before it was ready:\n%s", p.Name, p.waitErr, p.Tail())
		}
		if code, _, err := p.Get(ctx, "/readyz"); err == nil && code == http.StatusOK {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready within %s:\n%s", p.Name, timeout, p.Tail())
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

type tailBuffer struct {
	mu  sync.Mutex
	max int
	buf bytes.Buffer
}

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf.Write(p)
	if over := b.buf.Len() - b.max; over > 0 {
		b.buf.Next(over)
	}
	return len(p), nil
}

func (b *tailBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// SignalContext is cancelled on SIGINT or SIGTERM; a second signal exits at
// once after running onForce (kill the children).
func SignalContext(onForce func()) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.Background())
	ch := make(chan os.Signal, 2)
	signal.Notify(ch, os.Interrupt, syscall.SIGTERM)
	go func() {
		sig := <-ch
		fmt.Fprintf(os.Stderr, "\n%s: stopping (again to force)\n", sig)
		cancel()
		<-ch
		onForce()
		os.Exit(130)
	}()
	return ctx, cancel
}

type lineWriter struct {
	mu  sync.Mutex
	buf []byte
	fn  func(string)
}

func (w *lineWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = append(w.buf, p...)
	for {
		i := bytes.IndexByte(w.buf, '\n')
		if i < 0 {
			return len(p), nil
		}
		w.fn(string(w.buf[:i]))
		w.buf = w.buf[i+1:]
	}
}
