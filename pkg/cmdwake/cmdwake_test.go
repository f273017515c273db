package cmdwake_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/cmdwake"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestCreatedCallsAreCoalesced: the first call notifies at once, the next
// 99 wait for the interval (an hour here) and go out in one NOTIFY when the
// notifier closes; together the two name every node.
func TestCreatedCallsAreCoalesced(t *testing.T) {
	db := pgtest.NewDB(t)
	if db.DirectURL == "" {
		t.Skip("no direct connection to LISTEN on")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, db.DirectURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, "LISTEN "+cmdwake.Channel)
	require.NoError(t, err)

	n := cmdwake.New(db.Pool, time.Hour, nil)
	n.Created("node-0")
	first, err := conn.WaitForNotification(ctx)
	require.NoError(t, err)
	require.Equal(t, []string{"node-0"}, cmdwake.Nodes(first.Payload))
	for i := 1; i < 100; i++ {
		n.Created(fmt.Sprintf("node-%d", i))
	}
	n.Close()
	n.Created("after-close") // ignored

	rest, err := conn.WaitForNotification(ctx)
	require.NoError(t, err)
	seen := map[string]bool{}
	for _, id := range cmdwake.Nodes(rest.Payload) {
		seen[id] = true
	}
	require.Len(t, seen, 99)
	// Nothing else was sent.
	short, cancel2 := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel2()
	_, err = conn.WaitForNotification(short)
	require.Error(t, err)
}

func TestLongListsWakeEverySession(t *testing.T) {
	db := pgtest.NewDB(t)
	if db.DirectURL == "" {
		t.Skip("no direct connection to LISTEN on")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, db.DirectURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, "LISTEN "+cmdwake.Channel)
	require.NoError(t, err)

	n := cmdwake.New(db.Pool, time.Hour, nil)
	n.Created("first")
	first, err := conn.WaitForNotification(ctx)
	require.NoError(t, err)
	require.Equal(t, []string{"first"}, cmdwake.Nodes(first.Payload))
	for i := range 2000 { // ~50 kB of ids: over the payload limit
		n.Created(fmt.Sprintf("node-with-a-long-name-%d", i))
	}
	n.Close()
	all, err := conn.WaitForNotification(ctx)
	require.NoError(t, err)
	require.Nil(t, cmdwake.Nodes(all.Payload), "an empty payload: every session")
}
