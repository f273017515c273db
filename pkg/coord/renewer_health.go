package coord

// The renewer's health: readiness after a pass, its /healthz/detail section
// and the held-lease gauges.

import (
	"context"
	"errors"
	"fmt"
	"time"
)

func (r *Renewer) setPassErr(err error) {
	r.mu.Lock()
	r.passErr = err
	r.mu.Unlock()
}

// Ready reports whether the process can reach the database and holds what it
// should: nil after a successful pass in which, for every sharded group, it
// holds at least one shard or was planned none. Before the first pass, and
// while passes fail, it returns why.
func (r *Renewer) Ready() error {
	r.mu.RLock()
	err, planned, passed := r.passErr, r.planned, !r.lastPass.IsZero()
	r.mu.RUnlock()
	if err != nil {
		return fmt.Errorf("last membership pass failed: %w", err)
	}
	if !passed {
		return errors.New("no membership pass has completed yet")
	}
	for _, g := range r.cfg.Groups {
		if planned[g.Name] > 0 && len(r.Shards(g)) == 0 {
			return fmt.Errorf("holds none of the %d shards of group %s planned for it", planned[g.Name], g.Name)
		}
	}
	return nil
}

// Detail is the renewer's section of /healthz/detail.
func (r *Renewer) Detail(context.Context) any {
	held := r.Held()
	type lease struct {
		Name      string    `json:"name"`
		Epoch     int64     `json:"epoch"`
		ExpiresAt time.Time `json:"expires_at"`
	}
	out := struct {
		Owner       string              `json:"owner"`
		NotifyMode  string              `json:"notify_mode"`
		LoopAge     string              `json:"renewal_loop_age"`
		Waiting     string              `json:"waiting_for,omitempty"`
		Ready       string              `json:"ready"`
		ClockSkew   string              `json:"clock_skew"`
		Shards      map[string]int      `json:"shards_held"`
		Singletons  []lease             `json:"singletons"`
		LiveMembers map[string][]string `json:"live_members"`
		Liveness    LivenessDetail      `json:"liveness"`
	}{Owner: r.client.Owner(), NotifyMode: r.NotifyMode(), LoopAge: r.loop.Age().Round(time.Millisecond).String(),
		Shards: map[string]int{}, LiveMembers: map[string][]string{}, Liveness: r.live.detail()}
	skew, _ := r.skew.Last()
	out.ClockSkew = skew.String()
	out.Waiting, _ = r.loop.Waiting()
	out.Ready = "yes"
	if err := r.Ready(); err != nil {
		out.Ready = err.Error()
	}
	for _, g := range r.cfg.Groups {
		out.Shards[g.Name] = len(r.Shards(g))
	}
	for _, l := range held {
		if _, isShard := r.shardGroup(l.Name); !isShard {
			out.Singletons = append(out.Singletons, lease{l.Name, l.Epoch, l.ExpiresAt})
		}
	}
	r.mu.RLock()
	for g, ms := range r.lastMembers {
		for _, m := range ms {
			out.LiveMembers[g] = append(out.LiveMembers[g], m.ID)
		}
	}
	r.mu.RUnlock()
	return out
}

func (r *Renewer) exportHeld() {
	held := r.Held()
	r.m.leasesHeld.Set(float64(len(held)))
	for _, g := range r.cfg.Groups {
		r.m.shardsOwned.WithLabelValues(g.Name).Set(float64(len(r.Shards(g))))
	}
	epochs := map[string]int64{}
	for _, l := range held {
		epochs[l.Name] = l.Epoch
	}
	for _, s := range r.singletons() {
		r.m.epochs.WithLabelValues(s).Set(float64(epochs[s]))
	}
}
