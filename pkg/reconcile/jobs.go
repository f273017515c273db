package reconcile

// Singleton jobs: registered by lease name and run by a supervisor while
// their process holds that lease.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leasehold/leasehold/pkg/coord"
)

// Job runs while its process holds the job's lease. ctx ends when the lease
// is lost, released or the process stops; every write goes through
// jc.RunFenced, fenced on the lease at the epoch the job started with.
type Job struct {
	// Name is the job's name; its lease is singleton:<Name> unless Lease is set.
	Name string
	// Lease overrides the lease name (e.g. metrics:command-latency).
	Lease string
	// Run works until ctx ends.
	Run func(ctx context.Context, jc *JobContext) error
}

// JobContext is what a running job gets: its lease and a fenced-transaction
// helper that always uses the latest renewal of that lease.
type JobContext struct {
	// Lease is the lease as taken when the job started.
	Lease coord.Lease
	rt    *Runtime
}

// Current returns the lease as last renewed, or ErrLeaseLost once it is no
// longer held at the job's epoch.
func (jc *JobContext) Current() (coord.Lease, error) {
	l, ok := jc.rt.renewer.Lease(jc.Lease.Name)
	if !ok || l.Epoch != jc.Lease.Epoch {
		return coord.Lease{}, &coord.LeaseLostError{Name: jc.Lease.Name, Epoch: jc.Lease.Epoch}
	}
	return l, nil
}

// RunFenced runs fn in a transaction fenced on the job's lease.
func (jc *JobContext) RunFenced(ctx context.Context, fn func(ctx context.Context, tx pgx.Tx) error) error {
	l, err := jc.Current()
	if err != nil {
		return err
	}
	return coord.RunFenced(ctx, jc.rt.db, l, jc.rt.fenceOptions(), fn)
}

// DB is the runtime's pool, for reads outside fenced transactions.
func (jc *JobContext) DB() *pgxpool.Pool { return jc.rt.db }

// LeaseName is the job's lease.
func (j Job) LeaseName() string {
	if j.Lease != "" {
		return j.Lease
	}
	return "singleton:" + j.Name
}

// RegisterJob adds a singleton job. Before start it is part of the first
// pass; while running it starts being taken from the next pass on.
func (rt *Runtime) RegisterJob(j Job) error {
	if err := coord.ValidateName(j.LeaseName()); err != nil {
		return fmt.Errorf("job %s: %w", j.Name, err)
	}
	if j.Run == nil {
		return fmt.Errorf("job %s: needs a Run func", j.Name)
	}
	for _, name := range rt.Jobs() {
		if name == j.LeaseName() {
			return fmt.Errorf("job %s: lease %s registered twice", j.Name, j.LeaseName())
		}
	}
	rt.jobsMu.Lock()
	rt.jobs = append(rt.jobs, j)
	running := rt.jobCtx != nil
	rt.jobsMu.Unlock()
	if running {
		if err := rt.renewer.AddSingleton(j.LeaseName()); err != nil {
			return err
		}
		rt.startJob(j)
	}
	return nil
}

// RemoveJob stops a running singleton job and releases its lease.
func (rt *Runtime) RemoveJob(ctx context.Context, leaseName string) error {
	rt.jobsMu.Lock()
	cancel := rt.jobCancel[leaseName]
	delete(rt.jobCancel, leaseName)
	kept := rt.jobs[:0:0]
	for _, j := range rt.jobs {
		if j.LeaseName() != leaseName {
			kept = append(kept, j)
		}
	}
	rt.jobs = kept
	rt.jobsMu.Unlock()
	if cancel != nil {
		cancel()
	}
	r := rt.Renewer() // may run while the runtime starts
	if r == nil {
		return nil
	}
	return r.RemoveSingleton(ctx, leaseName)
}

// Jobs returns the lease names of the registered jobs.
func (rt *Runtime) Jobs() []string {
	rt.jobsMu.Lock()
	defer rt.jobsMu.Unlock()
	out := make([]string, len(rt.jobs))
	for i, j := range rt.jobs {
		out[i] = j.LeaseName()
	}
	return out
}

func (rt *Runtime) startJob(j Job) {
	rt.jobsMu.Lock()
	ctx, cancel := context.WithCancel(rt.jobCtx)
	rt.jobCancel[j.LeaseName()] = cancel
	rt.jobsMu.Unlock()
	rt.wg.Add(1)
	go func() { defer rt.wg.Done(); rt.superviseJob(ctx, j) }()
}

// superviseJob runs j while its lease is held: it starts Run when the lease
// is taken and cancels it when the lease is lost, released, or its epoch
// changes, then waits for the next take.
func (rt *Runtime) superviseJob(ctx context.Context, j Job) {
	name := j.LeaseName()
	for {
		lease, held := rt.renewer.Lease(name)
		if !held {
			select {
			case <-ctx.Done():
				return
			case <-rt.renewer.Changed():
			case <-rt.clock.After(rt.cfg.Timings.Tick()):
			}
			continue
		}
		if rt.stalledOut() {
			return
		}
		jctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- j.Run(jctx, &JobContext{Lease: lease, rt: rt}) }()
		rt.logger.Info("singleton job started", "job", j.Name, "lease", name, "epoch", lease.Epoch)
		err := rt.watchLease(ctx, name, lease.Epoch, done)
		cancel()
		if err == nil {
			err = <-done
		}
		switch {
		case ctx.Err() != nil:
			return
		case errors.Is(err, coord.ErrLeaseLost):
			rt.m.fenceFailures.WithLabelValues("singleton").Inc()
			rt.logger.Warn("singleton job stopped: lease lost", "job", j.Name, "epoch", lease.Epoch)
		case err != nil && !errors.Is(err, context.Canceled):
			rt.logger.Warn("singleton job failed; restarting while the lease is held", "job", j.Name, "err", err)
			select {
			case <-ctx.Done():
				return
			case <-rt.clock.After(time.Second):
			}
		default:
			rt.logger.Info("singleton job stopped", "job", j.Name, "epoch", lease.Epoch)
		}
	}
}

// watchLease returns nil when the lease (name, epoch) stops being held, or
// the job's own error when it returns first.
func (rt *Runtime) watchLease(ctx context.Context, name string, epoch int64, done <-chan error) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-done:
			if err == nil {
				err = context.Canceled // returned on its own: treat as stopped
			}
			return err
		case <-rt.renewer.Changed():
		case <-rt.clock.After(rt.cfg.Timings.Tick()):
		}
		if l, ok := rt.renewer.Lease(name); !ok || l.Epoch != epoch || rt.stalledOut() {
			return nil
		}
	}
}
