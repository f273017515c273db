package pgnotify_test

import (
	"context"
	"testing"
	"time"

	"github.com/jonboulle/clockwork"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgnotify"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// recv returns the next value on ch, failing the test if none comes within
// 10 s (a bound on the database's answer, not a wait for time to pass).
func recv[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
		panic("unreachable")
	}
}

// TestListenDeliversAndReconnects: each channel's notifications reach its
// handler; after the session is killed the listener waits out its reconnect
// delay on its clock (a fake one here), then reconnects by itself, calls
// OnConnect again and delivers again.
func TestListenDeliversAndReconnects(t *testing.T) {
	t.Parallel()
	if !pgtest.NotifyAvailable() {
		t.Skip("no LISTEN in this pgtest mode")
	}
	db := pgtest.NewDB(t)
	ctx, cancel := context.WithCancel(context.Background())
	clock := clockwork.NewFakeClock()
	const delay = time.Minute
	commands, specs := make(chan string, 8), make(chan string, 8)
	connects, losses := make(chan struct{}, 4), make(chan error, 4)
	done := make(chan error, 1)
	go func() {
		done <- pgnotify.Listen(ctx, pgnotify.Config{
			URL: db.DirectURL,
			Handlers: map[string]func(string){
				pgnotify.Commands: func(p string) { commands <- p },
				pgnotify.NodeSpec: func(p string) { specs <- p },
			},
			OnConnect:      func() { connects <- struct{}{} },
			OnLost:         func(err error) { losses <- err },
			ReconnectDelay: delay,
			Clock:          clock,
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

	recv(t, connects, "the first connect")
	notify(pgnotify.Commands, "node-a")
	notify(pgnotify.NodeSpec, "node-b")
	require.Equal(t, "node-a", recv(t, commands, "node-a on its channel"))
	require.Equal(t, "node-b", recv(t, specs, "node-b on its channel"))
	require.Empty(t, commands, "each channel reaches only its own handler")

	var killed int
	require.NoError(t, db.Pool.QueryRow(context.Background(),
		`SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = $1 AND query LIKE 'LISTEN %'`,
		db.Name).Scan(&killed))
	require.Equal(t, 1, killed, "the listener's session was found and killed")
	require.Error(t, recv(t, losses, "the loss"))

	// The listener waits out the delay on its clock: a millisecond short of
	// it, the wait is still pending and no session has been opened.
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	require.NoError(t, clock.BlockUntilContext(wctx, 1), "the reconnect waits on the clock")
	clock.Advance(delay - time.Millisecond)
	short, scancel := context.WithTimeout(context.Background(), time.Second)
	defer scancel()
	require.NoError(t, clock.BlockUntilContext(short, 1), "still waiting a millisecond before the delay ends")
	require.Empty(t, connects, "no reconnect before the delay")
	clock.Advance(time.Millisecond)
	recv(t, connects, "the reconnect once the delay passed")
	require.Empty(t, losses, "one loss, one reconnect")
	notify(pgnotify.Commands, "node-c")
	require.Equal(t, "node-c", recv(t, commands, "node-c after the reconnect"))
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
