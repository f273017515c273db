package gateway

import (
	"context"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jonboulle/clockwork"
	"github.com/stretchr/testify/require"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

func piece(cmd string, off int64) *nodev1.CommandOutput {
	return &nodev1.CommandOutput{CommandId: cmd, Offset: off, Stream: nodev1.OutputStream_OUTPUT_STREAM_STDOUT, Data: []byte("x")}
}

// TestOutputWatchers drives the live-output watchers with a fake clock: a
// full watcher holds the read loop (the session marked held back) until
// it has room, or for watchStall and then is ended RESOURCE_EXHAUSTED; the
// result ends a watcher after every piece it got; pieces of the same
// command on another session, and of other commands, are not its own; a
// closed session ends its watchers UNAVAILABLE.
func TestOutputWatchers(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	clock := clockwork.NewFakeClock()
	o := &outputWatchers{clock: clock}
	s, other := &session{nodeID: "n1"}, &session{nodeID: "n1"}

	t.Run("a full watcher that drains within the stall gets the piece", func(t *testing.T) {
		w := o.add(s, "c1")
		defer o.remove(w)
		for i := range watchQueue {
			o.publish(ctx, s, piece("c1", int64(i)))
		}
		published := make(chan struct{})
		go func() {
			o.publish(ctx, s, piece("c1", watchQueue))
			close(published)
		}()
		require.NoError(t, clock.BlockUntilContext(ctx, 1))
		require.True(t, s.heldBack.Load(), "the session is held back while it waits")
		require.Equal(t, int64(0), (<-w.ch).GetOffset())
		<-published
		require.False(t, s.heldBack.Load())
		select {
		case <-w.ended:
			t.Fatal("a watcher that made room was ended")
		default:
		}
		require.Len(t, w.ch, watchQueue)
	})

	t.Run("a watcher still full after the stall is ended", func(t *testing.T) {
		w := o.add(s, "c2")
		defer o.remove(w)
		for i := range watchQueue {
			o.publish(ctx, s, piece("c2", int64(i)))
		}
		published := make(chan struct{})
		go func() {
			o.publish(ctx, s, piece("c2", watchQueue))
			close(published)
		}()
		require.NoError(t, clock.BlockUntilContext(ctx, 1))
		clock.Advance(watchStall)
		<-published
		<-w.ended
		err, _ := o.outcome(w)
		require.Equal(t, connect.CodeResourceExhausted, err.Code())
		require.ErrorContains(t, err, "fell more than 256 pieces behind at offset 256")
	})

	t.Run("the result ends a watcher after its pieces; others' pieces are not its own", func(t *testing.T) {
		w := o.add(s, "c3")
		defer o.remove(w)
		o.publish(ctx, other, piece("c3", 0)) // the same node's older session
		o.publish(ctx, s, piece("c4", 0))     // another command
		o.publish(ctx, s, piece("c3", 7))
		s.outputRead("c3", 8)
		o.finish(s, "c3", s.outputFinished("c3"))
		<-w.ended
		err, end := o.outcome(w)
		require.Nil(t, err)
		require.Equal(t, int64(8), end)
		require.Len(t, w.ch, 1)
		require.Equal(t, int64(7), (<-w.ch).GetOffset())

		// A watch that comes after the result finds where the output ended.
		got, ok := s.finishedOutputEnd("c3")
		require.True(t, ok)
		require.Equal(t, int64(8), got)
		// A result sent again keeps it.
		require.Equal(t, int64(8), s.outputFinished("c3"))
	})

	t.Run("a closed session ends its watchers", func(t *testing.T) {
		w, kept := o.add(s, "c5"), o.add(other, "c5")
		defer o.remove(w)
		defer o.remove(kept)
		o.endSession(s)
		<-w.ended
		err, _ := o.outcome(w)
		require.Equal(t, connect.CodeUnavailable, err.Code())
		select {
		case <-kept.ended:
			t.Fatal("a watcher on another session was ended")
		default:
		}
	})

	require.Equal(t, int64(0), o.n.Load(), "every watch was removed")
}

// TestOutputKeptForLateWatchers: a watch that comes after pieces passed
// gets them first, in order, then the live ones; one that comes after the
// result gets them and the end; a command keeps at most keptPerCommand
// bytes (then nothing more, so the reader sees the gap); what is kept goes
// keptFor after the result, or with the session of a running command.
func TestOutputKeptForLateWatchers(t *testing.T) {
	ctx := context.Background()
	clock := clockwork.NewFakeClock()
	o := &outputWatchers{clock: clock}
	s := &session{nodeID: "n1"}
	big := func(cmd string, off int64, n int) *nodev1.CommandOutput {
		return &nodev1.CommandOutput{CommandId: cmd, Offset: off, Data: make([]byte, n)}
	}

	o.publish(ctx, s, piece("c1", 10))
	o.publish(ctx, s, piece("c1", 11))
	w := o.add(s, "c1")
	o.publish(ctx, s, piece("c1", 12))
	for _, want := range []int64{10, 11, 12} {
		require.Equal(t, want, (<-w.ch).GetOffset())
	}
	o.finish(s, "c1", 13)
	<-w.ended
	o.remove(w)

	late := o.add(s, "c1") // after the result: kept pieces, then the end
	o.finishOne(late, 13)
	require.Len(t, late.ch, 3)
	o.remove(late)

	// At most keptPerCommand bytes of one command.
	const piece64 = 64 << 10
	for i := range keptPerCommand/piece64 + 2 {
		o.publish(ctx, s, big("c2", int64(i*piece64), piece64))
	}
	require.Equal(t, int64(keptPerCommand), o.kept["c2"].bytes)
	require.True(t, o.kept["c2"].full)

	// A running command's kept output goes with its session; a finished
	// one's after keptFor.
	o.endSession(s)
	require.NotContains(t, o.kept, "c2")
	require.Contains(t, o.kept, "c1")
	clock.Advance(keptFor)
	o.finish(s, "c3", 0)
	require.NotContains(t, o.kept, "c1")
	require.Equal(t, int64(0), o.keptBytes)
}
