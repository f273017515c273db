package coord

// The renewer's LISTEN side: a released lease it wants triggers a pass at once,
// and NotifyMode says whether it listens or only polls.

import (
	"context"

	"github.com/leasehold/leasehold/pkg/pgnotify"
)

// NotifyMode is "listen" while LISTEN is connected and "polling" otherwise.
func (r *Renewer) NotifyMode() string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.notifyMode
}

func (r *Renewer) setNotifyMode(m string) {
	r.mu.Lock()
	r.notifyMode = m
	r.mu.Unlock()
}

// listen keeps a LISTEN session on pgnotify.LeaseReleased and triggers a
// pass when a lease this process wants is released. pgnotify reconnects
// after errors; on every (re)connect a pass runs, since notifications may
// have been missed.
func (r *Renewer) listen(ctx context.Context, url string) {
	_ = pgnotify.Listen(ctx, pgnotify.Config{
		URL: url,
		Handlers: map[string]func(string){pgnotify.LeaseReleased: func(name string) {
			if r.interested(name) {
				r.Trigger("notify")
			}
		}},
		OnConnect: func() {
			r.setNotifyMode("listen")
			r.Trigger("listen-connected")
		},
		OnLost: func(err error) {
			r.setNotifyMode("polling")
			r.logger.Warn("LISTEN connection lost; polling until it is back", "err", err)
		},
		Clock: r.clock,
	})
	r.setNotifyMode("polling")
}

// interested reports whether a released lease is one this process may take:
// a singleton it runs or a shard of one of its groups that it does not hold.
func (r *Renewer) interested(name string) bool {
	for _, s := range r.singletons() {
		if s == name {
			return true
		}
	}
	if _, ok := r.shardGroup(name); ok {
		_, held := r.Lease(name)
		return !held
	}
	return false
}
