package coord

// The renewer's held set: the leases the last pass returned, the singletons
// it takes, and the Changed channel closed whenever that set changes.

import (
	"context"
	"fmt"
	"sort"
)

func (r *Renewer) singletons() []string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return append([]string(nil), r.cfg.Singletons...)
}

// AddSingleton starts taking singleton lease name from the next pass on.
func (r *Renewer) AddSingleton(name string) error {
	if err := ValidateName(name); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range r.cfg.Singletons {
		if s == name {
			return nil
		}
	}
	r.cfg.Singletons = append(r.cfg.Singletons, name)
	r.Trigger("singleton-added")
	return nil
}

// RemoveSingleton stops taking name and releases it if held, so another
// process need not wait for the TTL (a deleted sink, say).
func (r *Renewer) RemoveSingleton(ctx context.Context, name string) error {
	r.mu.Lock()
	kept := r.cfg.Singletons[:0:0]
	for _, s := range r.cfg.Singletons {
		if s != name {
			kept = append(kept, s)
		}
	}
	r.cfg.Singletons = kept
	r.mu.Unlock()
	released, err := r.client.Release(ctx, name)
	r.forget(released...)
	return err
}

// trusted caps a held lease's validity by the liveness session's trust
// deadline when liveness is on (liveness.go): a member whose session
// stopped answering stops trusting every lease at once.
func (r *Renewer) trusted(l Lease) Lease {
	if r.live == nil {
		return l
	}
	if until := r.live.trustUntil(); until.Before(l.ValidUntil) {
		l.ValidUntil = until
	}
	return l
}

// Lease returns the held lease called name while it is still valid (and,
// with liveness on, trusted) on the process clock.
func (r *Renewer) Lease(name string) (Lease, bool) {
	r.mu.RLock()
	l, ok := r.held[name]
	r.mu.RUnlock()
	l = r.trusted(l)
	if !ok || !r.clock.Now().Before(l.ValidUntil) {
		return Lease{}, false
	}
	return l, true
}

// Shards returns the shards of g this process holds validly, sorted.
func (r *Renewer) Shards(g Group) []int {
	now := r.clock.Now()
	r.mu.RLock()
	defer r.mu.RUnlock()
	var out []int
	for name, l := range r.held {
		if n, ok := g.ShardOfLease(name); ok && now.Before(r.trusted(l).ValidUntil) {
			out = append(out, n)
		}
	}
	sort.Ints(out)
	return out
}

// Held returns every lease held validly now.
func (r *Renewer) Held() []Lease {
	now := r.clock.Now()
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make([]Lease, 0, len(r.held))
	for _, l := range r.held {
		if l = r.trusted(l); now.Before(l.ValidUntil) {
			out = append(out, l)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Changed returns a channel closed at the next change of the held set.
func (r *Renewer) Changed() <-chan struct{} {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.changed
}

func (r *Renewer) shardGroup(name string) (Group, bool) {
	for _, g := range r.cfg.Groups {
		if _, ok := g.ShardOfLease(name); ok {
			return g, true
		}
	}
	return Group{}, false
}

// apply replaces the held set with the grant; a previously held name that
// was wanted but not granted has been lost.
func (r *Renewer) apply(g Grant, want []string) {
	r.mu.Lock()
	before := len(r.held)
	added := 0
	wanted := make(map[string]bool, len(want))
	for _, n := range want {
		wanted[n] = true
	}
	next := make(map[string]Lease, len(g.Leases))
	for _, l := range g.Leases {
		if old, ok := r.held[l.Name]; !ok || old.Epoch != l.Epoch {
			added++
			if _, shard := r.shardGroup(l.Name); !shard {
				r.logger.Info("singleton lease taken", "lease", l.Name, "epoch", l.Epoch)
			}
		}
		next[l.Name] = l
	}
	var lost []string
	for name := range r.held {
		if _, ok := next[name]; !ok && wanted[name] {
			lost = append(lost, name)
		}
	}
	r.held = next
	changed := added > 0 || len(lost) > 0 || before != len(next)
	if changed {
		close(r.changed)
		r.changed = make(chan struct{})
	}
	r.mu.Unlock()
	if len(lost) > 0 {
		r.m.leasesLost.Add(float64(len(lost)))
		r.logger.Warn("leases lost: another owner holds them now", "count", len(lost), "leases", truncate(lost, 8))
	}
	if added > 0 {
		r.logger.Info("leases acquired", "count", added, "held", len(next))
	}
	r.exportHeld()
}

func (r *Renewer) forget(names ...string) {
	if len(names) == 0 {
		return
	}
	r.mu.Lock()
	for _, n := range names {
		delete(r.held, n)
	}
	close(r.changed)
	r.changed = make(chan struct{})
	r.mu.Unlock()
	r.exportHeld()
}

func truncate(s []string, n int) []string {
	sort.Strings(s)
	if len(s) > n {
		return append(s[:n:n], fmt.Sprintf("… %d more", len(s)-n))
	}
	return s
}
