package api

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/leasehold/leasehold/pkg/pgdb"
)

// waiter serves every WaitCommand of the process with one poll: each tick
// it asks the database which of the awaited commands have finished and
// wakes their waiters. Results are written by gateways, which send no
// notification for them, so a poll (every 100 ms by default) is the
// mechanism, and one query per tick whatever the number of waiters.
type waiter struct {
	db       pgdb.Querier
	interval time.Duration
	log      *slog.Logger

	mu      sync.Mutex
	waiting map[string]map[chan struct{}]struct{}
	stop    chan struct{}
	once    sync.Once
}

func newWaiter(db pgdb.Querier, interval time.Duration, log *slog.Logger) *waiter {
	return &waiter{db: db, interval: interval, log: log, waiting: map[string]map[chan struct{}]struct{}{}, stop: make(chan struct{})}
}

// register returns a channel closed when command id finishes, and a
// function that stops waiting.
func (w *waiter) register(id string) (<-chan struct{}, func()) {
	ch := make(chan struct{})
	w.mu.Lock()
	set := w.waiting[id]
	if set == nil {
		set = map[chan struct{}]struct{}{}
		w.waiting[id] = set
	}
	set[ch] = struct{}{}
	w.mu.Unlock()
	return ch, func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		if set, ok := w.waiting[id]; ok {
			delete(set, ch)
			if len(set) == 0 {
				delete(w.waiting, id)
			}
		}
	}
}

// stopping is closed when the server stops: waiters answer at once.
func (w *waiter) stopping() <-chan struct{} { return w.stop }

// run polls until ctx ends.
func (w *waiter) run(ctx context.Context) {
	defer w.once.Do(func() { close(w.stop) })
	t := time.NewTicker(w.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		w.poll(ctx)
	}
}

func (w *waiter) poll(ctx context.Context) {
	w.mu.Lock()
	ids := make([]string, 0, len(w.waiting))
	for id := range w.waiting {
		ids = append(ids, id)
	}
	w.mu.Unlock()
	if len(ids) == 0 {
		return
	}
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	rows, err := w.db.Query(qctx, finishedCommandsSQL, ids)
	if err != nil {
		w.log.WarnContext(ctx, "wait poll", "err", err)
		return
	}
	defer rows.Close()
	var done []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			w.log.WarnContext(ctx, "wait poll", "err", err)
			return
		}
		done = append(done, id)
	}
	if err := rows.Err(); err != nil {
		w.log.WarnContext(ctx, "wait poll", "err", err)
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, id := range done {
		for ch := range w.waiting[id] {
			close(ch)
		}
		delete(w.waiting, id)
	}
}

// len is the number of commands being waited for.
func (w *waiter) len() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.waiting)
}
