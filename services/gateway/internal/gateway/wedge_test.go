package gateway

import (
	"bytes"
	"context"
	"crypto/rand"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// Nothing a node sends can wedge its session or its commands: output is
// bounded at the gateway, a flood of it does not starve heartbeats, a
// command too large to send fails alone, a result the database refuses
// ends its command instead of looping, and a command keeps one result.

// dispatchedTo inserts a command for nodeID and waits for the raw session
// to receive it.
func dispatchedTo(t *testing.T, db *pgtest.DB, s *rawSession, nodeID string) string {
	t.Helper()
	id := insertCommand(t, db, nodeID, "exec")
	m, err := s.recv(t, 10*time.Second)
	require.NoError(t, err)
	require.Equal(t, id, m.GetCommand().GetCommandId())
	return id
}

// randomBytes is n bytes that do not compress: the limit on a sent message
// applies after compression.
func randomBytes(t *testing.T, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return b
}

func commandState(t *testing.T, db *pgtest.DB, id string) string {
	t.Helper()
	var st string
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT state FROM commands WHERE id = $1`, id).Scan(&st))
	return st
}

func sessionEpoch(t *testing.T, db *pgtest.DB, nodeID string) int64 {
	t.Helper()
	var e int64
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT session_epoch FROM node_sessions WHERE node_id = $1`, nodeID).Scan(&e))
	return e
}

// sendOutput sends total bytes of output for id from offset base in pieces of piece bytes
// from a goroutine (a Send may block while the gateway holds the stream
// back) and returns a channel closed when all are sent.
func sendOutput(s *rawSession, id string, base, total, piece int) <-chan error {
	done := make(chan error, 1)
	go func() {
		data := strings.Repeat("o", piece)
		for off := base; off < base+total; off += piece {
			if err := s.stream.Send(outputMsg(id, int64(off), nodev1.OutputStream_OUTPUT_STREAM_STDOUT, data)); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	return done
}

// TestOutputCappedBeforeQueueing: with the group commit stuck on the
// command's row, a node sending three times the cap gets no more than the
// cap queued at the gateway (today's code queued all of it), and once the
// commit goes on exactly the cap is stored with its truncation marker.
func TestOutputCappedBeforeQueueing(t *testing.T) {
	t.Parallel()
	cfg := testConfig()
	cfg.OutputCap = 256 << 10
	db, g, s := oneNodeSession(t, cfg)
	id := dispatchedTo(t, db, s, "n-0")

	release := lockCommand(t, db, id)
	require.NoError(t, s.stream.Send(outputMsg(id, 0, nodev1.OutputStream_OUTPUT_STREAM_STDOUT, "x")))
	awaitBlockedOutput(t, db)
	require.NoError(t, <-sendOutput(s, id, 1, int(3*cfg.OutputCap), 32<<10))
	s.sync(t, 1) // every piece has been read and handled
	require.LessOrEqual(t, g.queuedOutputPeak.Load(), cfg.OutputCap, "bytes past the cap were queued")
	release()

	require.Eventually(t, func() bool { return g.queuedOutput.Load() == 0 }, 20*time.Second, 10*time.Millisecond)
	got := storedOutput(t, db, id)
	var n int64
	for _, p := range got {
		if p.stream == "stdout" {
			n += int64(len(p.data))
		}
	}
	require.Equal(t, cfg.OutputCap, n)
	require.Equal(t, storedPiece{cfg.OutputCap, "truncated", []byte{}}, got[len(got)-1])
}

// TestOutputBudgetBoundsQueuedBytes: under a cap far above the session's
// output budget, with the group commit stuck, the gateway stops reading
// the stream once the budget is queued (the node's Sends block), and when
// the commit goes on every byte is stored: backpressure, not loss.
func TestOutputBudgetBoundsQueuedBytes(t *testing.T) {
	t.Parallel()
	cfg := testConfig()
	cfg.OutputCap = 1 << 30
	db, g, s := oneNodeSession(t, cfg)
	id := dispatchedTo(t, db, s, "n-0")

	release := lockCommand(t, db, id)
	require.NoError(t, s.stream.Send(outputMsg(id, 0, nodev1.OutputStream_OUTPUT_STREAM_STDOUT, "x")))
	awaitBlockedOutput(t, db)
	total := 3 * sessionOutputBudget
	sent := sendOutput(s, id, 1, total, 64<<10)
	// The gateway fills the budget and then holds the stream back.
	require.Eventually(t, func() bool { return g.queuedOutput.Load() >= sessionOutputBudget-(64<<10) },
		20*time.Second, 10*time.Millisecond)
	select {
	case err := <-sent:
		t.Fatalf("all %d bytes were taken while the commit was stuck (err %v)", total, err)
	case <-time.After(500 * time.Millisecond):
	}
	require.LessOrEqual(t, g.queuedOutputPeak.Load(), int64(sessionOutputBudget))
	release()
	require.NoError(t, <-sent)
	s.sync(t, 1)
	require.Eventually(t, func() bool {
		var n int64
		require.NoError(t, db.Pool.QueryRow(context.Background(),
			`SELECT coalesce(sum(length(data)), 0) FROM command_output WHERE command_id = $1`, id).Scan(&n))
		return n == int64(total)+1
	}, 30*time.Second, 20*time.Millisecond)
	require.LessOrEqual(t, g.queuedOutputPeak.Load(), int64(sessionOutputBudget))
}

// awaitBlockedOutput waits until the group commit waits on a row lock
// (pg_stat_activity shows only the statement's first kilobyte).
func awaitBlockedOutput(t *testing.T, db *pgtest.DB) {
	t.Helper()
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, db.Pool.QueryRow(context.Background(), `
SELECT count(*) FROM pg_stat_activity
 WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%WITH r AS%'`).Scan(&n))
		return n > 0
	}, 10*time.Second, 5*time.Millisecond, "the group commit never waited on the locked command")
}

// TestOutputFloodKeepsHeartbeats: while a node streams output as fast as
// it can for longer than a daemon's heartbeat timeout, every heartbeat is
// acknowledged in time and the session stays up.
func TestOutputFloodKeepsHeartbeats(t *testing.T) {
	t.Parallel()
	cfg := testConfig()
	cfg.HeartbeatInterval = 200 * time.Millisecond
	cfg.OutputCap = 1 << 30
	db, _, s := oneNodeSession(t, cfg)
	id := dispatchedTo(t, db, s, "n-0")

	// The daemon's timeout for this interval: min(2*interval+2s, 15s).
	timeout := 2*cfg.HeartbeatInterval + 2*time.Second
	flood := 2 * timeout
	var (
		mu      sync.Mutex
		sentAt  = map[uint64]time.Time{}
		worst   time.Duration
		acked   int
		last    uint64
		recvErr error
	)
	recvDone := make(chan struct{})
	go func() {
		defer close(recvDone)
		for {
			m, err := s.stream.Receive()
			if err != nil {
				mu.Lock()
				recvErr = err
				mu.Unlock()
				return
			}
			if a := m.GetHeartbeatAck(); a != nil {
				mu.Lock()
				if d := time.Since(sentAt[a.GetSequence()]); d > worst {
					worst = d
				}
				acked++
				last = a.GetSequence()
				mu.Unlock()
			}
		}
	}()
	data := bytes.Repeat([]byte("f"), 64<<10)
	start := time.Now()
	next := start
	var seq uint64
	var off int64
	for time.Since(start) < flood {
		if time.Now().After(next) {
			seq++
			mu.Lock()
			sentAt[seq] = time.Now()
			mu.Unlock()
			require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Heartbeat{Heartbeat: &nodev1.Heartbeat{Sequence: seq}}}))
			next = time.Now().Add(cfg.HeartbeatInterval)
		}
		require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandOutput{CommandOutput: &nodev1.CommandOutput{
			CommandId: id, Offset: off, Stream: nodev1.OutputStream_OUTPUT_STREAM_STDOUT, Data: data}}}))
		off += int64(len(data))
	}
	t.Logf("flooded %d MiB in %s; %d heartbeats sent", off>>20, flood, seq)
	// The last heartbeat is answered too.
	mu.Lock()
	sentAt[seq+1] = time.Now()
	mu.Unlock()
	require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Heartbeat{Heartbeat: &nodev1.Heartbeat{Sequence: seq + 1}}}))
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return last == seq+1 || recvErr != nil
	}, 10*time.Second, 5*time.Millisecond)
	mu.Lock()
	w, n, rerr := worst, acked, recvErr
	mu.Unlock()
	t.Logf("longest wait for a HeartbeatAck: %s", w)
	require.NoError(t, rerr)
	require.Less(t, w, timeout, "a heartbeat waited longer than the daemon's timeout for its ack")
	require.GreaterOrEqual(t, n, int(seq)/2)
	require.Equal(t, int64(1), sessionEpoch(t, db, "n-0"), "the node said Hello again")
	require.Equal(t, "dispatched", commandState(t, db, id))
}
