package api

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgnotify"
)

// waiter serves every WaitCommand of the process with one query per
// check, whatever the number of waiters: it asks the database which of the
// awaited commands have finished and wakes their waiters. A check runs
// when a gateway's group commit finishes commands (it NOTIFYs
// leasehold_command_done once per batch, which this process LISTENs for on
// a direct connection) and at every poll interval, the fallback when
// notifications are off or lost.
type waiter struct {
	db        pgdb.Querier
	notifyURL string
	interval  time.Duration
	log       *slog.Logger
	kick      chan struct{}
	// listening is true while the LISTEN connection is up.
	listening atomic.Bool

	// output wakes StreamCommandOutput readers (output.go) from the same
	// LISTEN connection.
	output *outputHub

	mu      sync.Mutex
	waiting map[string]map[chan struct{}]struct{}
	stop    chan struct{}
	once    sync.Once
}

func newWaiter(db pgdb.Querier, notifyURL string, interval time.Duration, log *slog.Logger) *waiter {
	return &waiter{db: db, notifyURL: notifyURL, interval: interval, log: log, kick: make(chan struct{}, 1), output: newOutputHub(),
		waiting: map[string]map[chan struct{}]struct{}{}, stop: make(chan struct{})}
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

// run checks at every notification and poll until ctx ends.
func (w *waiter) run(ctx context.Context) {
	defer w.once.Do(func() { close(w.stop) })
	if w.notifyURL != "" {
		listenDone := make(chan struct{})
		defer func() { <-listenDone }()
		go func() { defer close(listenDone); w.listenLoop(ctx) }()
	}
	t := time.NewTicker(w.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-w.kick:
		}
		w.poll(ctx)
	}
}

// listenLoop LISTENs (pkg/pgnotify) for finished commands and live output
// until ctx ends: a finished command kicks a check (coalesced: one pending
// kick at most) and wakes every output reader, since it ends their
// streams; output wakes the readers of the commands it names. pgnotify
// reconnects after a lost session, the poll covering the gap, and every
// (re)connect catches up on what finished while not listening.
func (w *waiter) listenLoop(ctx context.Context) {
	defer w.listening.Store(false)
	_ = pgnotify.Listen(ctx, pgnotify.Config{
		URL: w.notifyURL,
		Handlers: map[string]func(string){
			// NOTIFYed by a gateway's group commit that finished commands.
			pgnotify.CommandDone: func(string) {
				w.signal()
				w.output.wake("") // a finished command ends its readers' streams
			},
			pgnotify.CommandOutput: w.output.wake,
		},
		OnConnect: func() {
			w.listening.Store(true)
			w.signal() // catch up on what finished while not listening
			w.output.wake("")
		},
		OnLost: func(err error) {
			w.listening.Store(false)
			w.log.WarnContext(ctx, "finished-command notifications lost; WaitCommand polls until reconnected", "err", err)
		},
	})
}

func (w *waiter) signal() {
	select {
	case w.kick <- struct{}{}:
	default:
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
