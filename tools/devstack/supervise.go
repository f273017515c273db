package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"
)

// restartPolicy is how a child that exits is restarted: after Min, doubled
// at each exit up to Max, and back to Min once a run lasted StableAfter.
type restartPolicy struct {
	Min, Max, StableAfter time.Duration
}

// child is one supervised service process.
type child struct {
	name   string
	path   string
	args   []string
	env    []string
	policy restartPolicy
	logger *slog.Logger

	mu       sync.Mutex
	pid      int
	restarts int
}

// PID is the current process's id (0 between runs).
func (c *child) PID() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.pid
}

// Restarts counts the restarts so far.
func (c *child) Restarts() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.restarts
}

// stopGrace bounds a child's graceful stop before SIGKILL.
const stopGrace = 30 * time.Second

// run keeps the child running until ctx ends, then stops it with SIGTERM
// (SIGKILL after stopGrace) and returns nil. It returns an error only
// when the binary cannot be started at all.
func (c *child) run(ctx context.Context) error {
	delay := c.policy.Min
	for {
		cmd := exec.Command(c.path, c.args...)
		cmd.Env = c.env
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		// Its own process group, so a terminal's Ctrl-C reaches only the
		// dev stack, which stops the children in order; and SIGTERM if the
		// dev stack dies without stopping them.
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
		if err := cmd.Start(); err != nil {
			return fmt.Errorf("start %s (run `make build` first): %w", c.path, err)
		}
		c.mu.Lock()
		c.pid = cmd.Process.Pid
		c.mu.Unlock()
		c.logger.Info("service started", "service", c.name, "pid", cmd.Process.Pid)
		started := time.Now()
		exited := make(chan error, 1)
		go func() { exited <- cmd.Wait() }()

		var err error
		select {
		case <-ctx.Done():
			c.stop(cmd, exited)
			return nil
		case err = <-exited:
		}
		c.mu.Lock()
		c.pid = 0
		c.mu.Unlock()
		if ctx.Err() != nil {
			return nil
		}
		up := time.Since(started)
		if up >= c.policy.StableAfter {
			delay = c.policy.Min
		}
		status := "exit status 0"
		if err != nil {
			status = err.Error()
		}
		c.logger.Warn("service exited; restarting it", "service", c.name, "status", status,
			"up", up.Round(time.Millisecond), "restart_in", delay, "restarts_so_far", c.Restarts())
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(delay):
		}
		c.mu.Lock()
		c.restarts++
		c.mu.Unlock()
		delay = min(2*delay, c.policy.Max)
	}
}

// stop sends SIGTERM (so the service releases its leases), and SIGKILL if
// it has not exited within stopGrace.
func (c *child) stop(cmd *exec.Cmd, exited <-chan error) {
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-exited:
		var ee *exec.ExitError
		if err != nil && !errors.As(err, &ee) {
			c.logger.Warn("service stop", "service", c.name, "err", err)
		} else if err != nil {
			c.logger.Warn("service stopped with an error", "service", c.name, "status", err.Error())
		}
	case <-time.After(stopGrace):
		c.logger.Warn("service did not stop in time; killing it", "service", c.name, "grace", stopGrace)
		_ = cmd.Process.Kill()
		<-exited
	}
}
