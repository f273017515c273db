package coord

// The renewer's LISTEN side: a released lease it wants triggers a pass at once,
// and NotifyMode says whether it listens or only polls.

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgxlisten"
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

// listen keeps a LISTEN connection on ReleaseChannel and triggers a pass when
// a lease this process wants is released. pgxlisten reconnects after errors;
// on every (re)connect a pass runs, since notifications may have been missed.
func (r *Renewer) listen(ctx context.Context, url string) {
	l := &pgxlisten.Listener{
		Connect: func(ctx context.Context) (*pgx.Conn, error) {
			cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			return pgx.Connect(cctx, url)
		},
		LogError: func(ctx context.Context, err error) {
			r.setNotifyMode("polling")
			if ctx.Err() == nil {
				r.logger.Warn("LISTEN connection lost; polling until it is back", "err", err)
			}
		},
		ReconnectDelay: time.Second,
	}
	l.Handle(ReleaseChannel, releaseHandler{r})
	_ = l.Listen(ctx)
	r.setNotifyMode("polling")
}

type releaseHandler struct{ r *Renewer }

func (h releaseHandler) HandleNotification(_ context.Context, n *pgconn.Notification, _ *pgx.Conn) error {
	if h.r.interested(n.Payload) {
		h.r.Trigger("notify")
	}
	return nil
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

// HandleBacklog runs on every (re)connect of the LISTEN connection.
func (h releaseHandler) HandleBacklog(context.Context, string, *pgx.Conn) error {
	h.r.setNotifyMode("listen")
	h.r.Trigger("listen-connected")
	return nil
}
