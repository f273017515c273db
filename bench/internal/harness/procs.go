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
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/leasehold/leasehold/pkg/proctest"
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
	*proctest.Child
	// LogPath is the file holding its output, when the supervisor has a LogDir.
	LogPath string

	tail *proctest.Buffer
}

// Start runs bin with args in its own process group. It dies with the bench.
func (s *Supervisor) Start(name, bin string, env []string, args ...string) (*Proc, error) {
	return s.StartLines(name, bin, env, nil, args...)
}

// StartLines is Start with onLine called for every line the process
// writes to stdout, as it is written.
func (s *Supervisor) StartLines(name, bin string, env []string, onLine func(string), args ...string) (*Proc, error) {
	p := &Proc{tail: &proctest.Buffer{Max: 32 << 10}}
	opts := proctest.ChildOptions{Env: env, Output: p.tail, OwnGroup: true}
	if s.LogDir != "" {
		p.LogPath = filepath.Join(s.LogDir, name+".log")
		f, err := os.Create(p.LogPath)
		if err != nil {
			return nil, err
		}
		opts.Output = io.MultiWriter(f, p.tail)
		opts.OnExit = func() { f.Close() }
		defer func() {
			if p.Child == nil {
				f.Close()
			}
		}()
	}
	if onLine != nil {
		opts.Stdout = &lineWriter{fn: onLine}
	}
	c, err := proctest.StartChild(name, bin, args, opts)
	if err != nil {
		return nil, err
	}
	p.Child = c
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
			p.KillGroup()
		}
	}
	for _, p := range procs {
		select {
		case <-p.Done():
		case <-time.After(10 * time.Second):
		}
	}
}

// Signal sends sig to the process.
func (p *Proc) Signal(sig syscall.Signal) error { return p.SendSignal(sig) }

// Kill sends SIGKILL and waits for the exit.
func (p *Proc) Kill() {
	_ = p.SendSignal(syscall.SIGKILL)
	<-p.Done()
}

// Wait waits up to timeout for the exit and returns the exit code.
func (p *Proc) Wait(timeout time.Duration) (int, bool) { return p.WaitExit(timeout) }

// Tail returns the last output of the process.
func (p *Proc) Tail() string { return p.tail.String() }

// Get fetches path from the process's --http-addr.
func (p *Proc) Get(ctx context.Context, path string) (int, string, error) {
	return p.Fetch(ctx, path, "")
}

// WaitReady polls /readyz until it answers 200.
func (p *Proc) WaitReady(ctx context.Context, timeout time.Duration) error {
	if err := p.AwaitStatus(ctx, "/readyz", http.StatusOK, timeout); err != nil {
		return fmt.Errorf("%w:\n%s", err, p.Tail())
	}
	return nil
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
