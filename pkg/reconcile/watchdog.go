package reconcile

// The watchdog: every loop beats a health.Loop; one that stalls past
// SelfReleaseAfter while the database answers makes the process release every
// lease and fail /livez. It also exports the role and queue-depth gauges.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/grafana/dskit/services"

	"github.com/leasehold/leasehold/pkg/health"
	"github.com/leasehold/leasehold/pkg/queue"
)

// AddHealth registers the runtime's liveness checks (every loop) and
// readiness (the first pass done) on h, and its detail section.
func (rt *Runtime) AddHealth(h *health.Handler) {
	h.AddLiveness("reconcile", func(ctx context.Context) error {
		r := rt.Renewer()
		if r == nil {
			return nil
		}
		if err := r.Loop().Check(ctx); err != nil {
			return err
		}
		for _, l := range rt.loopList() {
			if err := l.Check(ctx); err != nil {
				return err
			}
		}
		return nil
	})
	// Ready while the runtime runs, the database answers and the process
	// holds what it should (Renewer.Ready); not ready during an outage, and
	// ready again by itself once the next pass succeeds.
	h.AddReadiness("leases", func(ctx context.Context) error {
		if rt.State() != services.Running {
			return fmt.Errorf("runtime is %s", rt.State())
		}
		if rt.stalledOut() {
			return errors.New("a loop stalled and every lease was released")
		}
		return rt.Renewer().Ready()
	})
	h.AddDetail("leases", func(ctx context.Context) any {
		r := rt.Renewer()
		if r == nil {
			return nil
		}
		return r.Detail(ctx)
	})
}

func (rt *Runtime) loopList() []*health.Loop {
	rt.loopsMu.Lock()
	defer rt.loopsMu.Unlock()
	out := make([]*health.Loop, 0, len(rt.loops))
	for _, l := range rt.loops {
		out = append(out, l)
	}
	return out
}

func (rt *Runtime) newLoop(name string) *health.Loop {
	l := health.NewLoop(name, rt.cfg.SelfReleaseAfter, rt.clock.Now)
	rt.loopsMu.Lock()
	rt.loops[name] = l
	rt.loopsMu.Unlock()
	return l
}

// watch self-releases when the renewal loop or a reconcile loop stalls, and
// exports queue depth.
func (rt *Runtime) watch(ctx context.Context) {
	tick := rt.clock.NewTicker(max(rt.cfg.Timings.Tick(), time.Second))
	defer tick.Stop()
	lastDepth := time.Time{}
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.Chan():
		}
		loops := append(rt.loopList(), rt.renewer.Loop())
		for _, l := range loops {
			if l.Age() > rt.cfg.SelfReleaseAfter {
				rt.selfRelease(ctx, l)
			}
		}
		rt.exportRole()
		if rt.clock.Since(lastDepth) >= 5*time.Second && len(rt.sharded) > 0 {
			lastDepth = rt.clock.Now()
			rt.exportDepth(ctx)
		}
	}
}

// exportRole sets leasehold_role{component="reconcile"}: fenced after a
// self-release, active while any lease is held, standby otherwise.
func (rt *Runtime) exportRole() {
	if rt.role == nil {
		return
	}
	switch {
	case rt.stalledOut():
		rt.role.Set(health.RoleFenced)
	case len(rt.renewer.Held()) > 0:
		rt.role.Set(health.RoleActive)
	default:
		rt.role.Set(health.RoleStandby)
	}
}

func (rt *Runtime) selfRelease(ctx context.Context, l *health.Loop) {
	rt.stallOnce.Do(func() {
		close(rt.stalled) // reconcile loops stop claiming
		rt.m.selfReleases.Inc()
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		released, err := rt.renewer.SelfRelease(rctx)
		rt.logger.Error("loop stalled while the database answered: released every lease; /livez now fails so the supervisor restarts this process",
			"loop", l.Name(), "stalled_for", l.Age().Round(time.Millisecond), "released", len(released), "err", err)
	})
}

func (rt *Runtime) exportDepth(ctx context.Context) {
	dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	stats, err := queue.Depth(dctx, rt.db)
	if err != nil {
		return
	}
	for _, s := range rt.sharded {
		st := stats[s.Name]
		rt.m.queueDepth.WithLabelValues(s.Name).Set(float64(st.Total))
		rt.m.queueOverdue.WithLabelValues(s.Name).Set(float64(st.Overdue))
	}
}

func (rt *Runtime) stalledOut() bool {
	select {
	case <-rt.stalled:
		return true
	default:
		return false
	}
}
