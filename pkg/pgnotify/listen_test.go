package pgnotify_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgnotify"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// received collects the payloads one handler sees.
type received struct {
	mu       sync.Mutex
	payloads []string
}

func (r *received) add(p string) {
	r.mu.Lock()
	r.payloads = append(r.payloads, p)
	r.mu.Unlock()
}

func (r *received) has(p string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, q := range r.payloads {
		if q == p {
			return true
		}
	}
	return false
}

// TestListenDeliversAndReconnects: each channel's notifications reach its
// handler; after the session is killed the listener reconnects by itself,
// calls OnConnect again and delivers again.
func TestListenDeliversAndReconnects(t *testing.T) {
	t.Parallel()
	if !pgtest.NotifyAvailable() {
		t.Skip("no LISTEN in this pgtest mode")
	}
	db := pgtest.NewDB(t)
	ctx, cancel := context.WithCancel(context.Background())
	var commands, specs received
	var connects, losses atomic.Int32
	done := make(chan error, 1)
	go func() {
		done <- pgnotify.Listen(ctx, pgnotify.Config{
			URL: db.DirectURL,
			Handlers: map[string]func(string){
				pgnotify.Commands: commands.add,
				pgnotify.NodeSpec: specs.add,
			},
			OnConnect:      func() { connects.Add(1) },
			OnLost:         func(error) { losses.Add(1) },
			ReconnectDelay: 10 * time.Millisecond,
		})
	}()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	notify := func(ch, payload string) {
		_, err := db.Pool.Exec(context.Background(), "SELECT pg_notify($1, $2)", ch, payload)
		require.NoError(t, err)
	}

	require.Eventually(t, func() bool { return connects.Load() == 1 }, 10*time.Second, 10*time.Millisecond)
	notify(pgnotify.Commands, "node-a")
	notify(pgnotify.NodeSpec, "node-b")
	require.Eventually(t, func() bool { return commands.has("node-a") && specs.has("node-b") }, 10*time.Second, 10*time.Millisecond)
	require.False(t, commands.has("node-b"), "each channel reaches only its own handler")

	var killed int
	require.NoError(t, db.Pool.QueryRow(context.Background(),
		`SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = $1 AND query LIKE 'LISTEN %'`,
		db.Name).Scan(&killed))
	require.Equal(t, 1, killed, "the listener's session was found and killed")
	require.Eventually(t, func() bool { return connects.Load() == 2 }, 10*time.Second, 10*time.Millisecond)
	require.EqualValues(t, 1, losses.Load())
	notify(pgnotify.Commands, "node-c")
	require.Eventually(t, func() bool { return commands.has("node-c") }, 10*time.Second, 10*time.Millisecond)
}

// TestListenRefusesAnEmptyConfig: nothing to listen on is an error, not a
// loop that spins.
func TestListenRefusesAnEmptyConfig(t *testing.T) {
	t.Parallel()
	err := pgnotify.Listen(context.Background(), pgnotify.Config{Handlers: map[string]func(string){pgnotify.Commands: func(string) {}}})
	require.ErrorContains(t, err, "no URL")
	err = pgnotify.Listen(context.Background(), pgnotify.Config{URL: "postgres://localhost/x"})
	require.ErrorContains(t, err, "no channel")
}
