package reconcile

import (
	"context"
	"errors"
	"time"

	"github.com/leasehold/leasehold/pkg/coord"
)

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
