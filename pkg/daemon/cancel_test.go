package daemon

import (
	"context"
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jonboulle/clockwork"
	"github.com/stretchr/testify/require"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// received collects what the daemon sends on one fake stream.
func receiveAll(s *stream, into chan<- *nodev1.ConnectRequest) {
	for {
		m, err := s.Receive()
		if err != nil {
			close(into)
			return
		}
		into <- m
	}
}

func next(t *testing.T, ch <-chan *nodev1.ConnectRequest, what string, match func(*nodev1.ConnectRequest) bool) *nodev1.ConnectRequest {
	t.Helper()
	deadline := time.After(30 * time.Second)
	for {
		select {
		case m, ok := <-ch:
			require.True(t, ok, "stream ended before %s", what)
			if match(m) {
				return m
			}
		case <-deadline:
			t.Fatalf("no %s", what)
		}
	}
}

func sendCmd(s *stream, id string) error {
	return s.Send(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Command{Command: &nodev1.Command{CommandId: id, Kind: "exec"}}})
}

func sendCancel(s *stream, id string) error {
	return s.Send(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_CancelCommand{CancelCommand: &nodev1.CancelCommand{CommandId: id}}})
}

// TestCancelStopsTheHandlerAndStreamsOutput: a running handler's output
// arrives as CommandOutput pieces with contiguous offsets per the order it
// was written; a CancelCommand cancels the handler's ctx, and the daemon
// sends the result, then CancelAck STOPPED, after the last piece.
func TestCancelStopsTheHandlerAndStreamsOutput(t *testing.T) {
	t.Parallel()
	got := make(chan *nodev1.ConnectRequest, 1000)
	var streams atomic.Pointer[stream]
	f := &fakeGateway{script: func(n int64, ctx context.Context, s *stream) error {
		if err := welcome(s); err != nil {
			return err
		}
		streams.Store(s)
		if err := sendCmd(s, "c1"); err != nil {
			return err
		}
		receiveAll(s, got)
		return nil
	}}
	addr := startFake(t, f)
	var handlerErr atomic.Value
	d, err := New(Config{Address: addr, NodeID: "n1", Credential: "c", OutputFlush: time.Millisecond,
		Handler: func(ctx context.Context, cmd *nodev1.Command) Outcome {
			_, _ = io.WriteString(Stdout(ctx), "hello ")
			_, _ = io.WriteString(Stderr(ctx), "warning\n")
			_, _ = io.WriteString(Stdout(ctx), "world\n")
			<-ctx.Done()
			handlerErr.Store(ctx.Err())
			_, _ = io.WriteString(Stdout(ctx), "bye\n")
			return Outcome{ExitCode: 130}
		}})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = d.Run(ctx) }()
	defer func() { cancel(); <-done }()

	var text strings.Builder
	var offset int64
	var streamsSeen []nodev1.OutputStream
	for !strings.Contains(text.String(), "world\n") {
		m := next(t, got, "output", func(m *nodev1.ConnectRequest) bool { return m.GetCommandOutput() != nil })
		o := m.GetCommandOutput()
		require.Equal(t, "c1", o.GetCommandId())
		require.Equal(t, offset, o.GetOffset(), "offsets are contiguous")
		offset += int64(len(o.GetData()))
		text.Write(o.GetData())
		streamsSeen = append(streamsSeen, o.GetStream())
	}
	require.Equal(t, "hello warning\nworld\n", text.String())
	require.Equal(t, []nodev1.OutputStream{nodev1.OutputStream_OUTPUT_STREAM_STDOUT, nodev1.OutputStream_OUTPUT_STREAM_STDERR,
		nodev1.OutputStream_OUTPUT_STREAM_STDOUT}, streamsSeen, "a change of stream starts a new piece")
	require.Nil(t, handlerErr.Load(), "the handler runs until cancelled")

	require.NoError(t, sendCancel(streams.Load(), "c1"))
	var order []string
	for len(order) == 0 || order[len(order)-1] != "ack" {
		m := next(t, got, "cancel ack", func(*nodev1.ConnectRequest) bool { return true })
		switch {
		case m.GetCommandOutput() != nil:
			require.Equal(t, offset, m.GetCommandOutput().GetOffset())
			require.Equal(t, "bye\n", string(m.GetCommandOutput().GetData()))
			order = append(order, "output")
		case m.GetCommandResult() != nil:
			require.Equal(t, "cancelled by CancelCommand", m.GetCommandResult().GetError())
			require.EqualValues(t, 130, m.GetCommandResult().GetExitCode())
			order = append(order, "result")
		case m.GetCancelAck() != nil:
			require.Equal(t, nodev1.CancelOutcome_CANCEL_OUTCOME_STOPPED, m.GetCancelAck().GetOutcome())
			order = append(order, "ack")
		}
	}
	require.Equal(t, []string{"output", "result", "ack"}, order)
	require.Equal(t, context.Canceled, handlerErr.Load())
	require.EqualValues(t, 1, d.Stats().Cancels)

	// Asked again (a new session would do so): still "stopped".
	require.NoError(t, sendCancel(streams.Load(), "c1"))
	m := next(t, got, "second ack", func(m *nodev1.ConnectRequest) bool { return m.GetCancelAck() != nil })
	require.Equal(t, nodev1.CancelOutcome_CANCEL_OUTCOME_STOPPED, m.GetCancelAck().GetOutcome())
}

// TestCancelOfUnknownAndFinishedCommands: a command never started is
// journalled cancelled (a later Command for it does not run) and answered
// NOT_STARTED; a finished one has its result re-sent and is answered
// ALREADY_FINISHED.
func TestCancelOfUnknownAndFinishedCommands(t *testing.T) {
	t.Parallel()
	got := make(chan *nodev1.ConnectRequest, 1000)
	var streams atomic.Pointer[stream]
	f := &fakeGateway{script: func(n int64, ctx context.Context, s *stream) error {
		if err := welcome(s); err != nil {
			return err
		}
		streams.Store(s)
		receiveAll(s, got)
		return nil
	}}
	addr := startFake(t, f)
	var runs atomic.Int64
	d, err := New(Config{Address: addr, NodeID: "n1", Credential: "c",
		Handler: func(ctx context.Context, cmd *nodev1.Command) Outcome {
			runs.Add(1)
			return Outcome{Output: []byte(fmt.Sprintf("ran %s", cmd.GetCommandId()))}
		}})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = d.Run(ctx) }()
	defer func() { cancel(); <-done }()
	require.Eventually(t, func() bool { return streams.Load() != nil }, 30*time.Second, 5*time.Millisecond)
	s := streams.Load()

	require.NoError(t, sendCancel(s, "never"))
	m := next(t, got, "result of the never-started command", func(m *nodev1.ConnectRequest) bool { return m.GetCommandResult() != nil })
	require.Equal(t, "cancelled before it started", m.GetCommandResult().GetError())
	m = next(t, got, "ack", func(m *nodev1.ConnectRequest) bool { return m.GetCancelAck() != nil })
	require.Equal(t, nodev1.CancelOutcome_CANCEL_OUTCOME_NOT_STARTED, m.GetCancelAck().GetOutcome())
	require.NoError(t, sendCmd(s, "never"))
	m = next(t, got, "re-sent result", func(m *nodev1.ConnectRequest) bool { return m.GetCommandResult() != nil })
	require.Equal(t, "never/cancelled", m.GetCommandResult().GetResultId())
	require.Zero(t, runs.Load(), "a command cancelled before it started never runs")

	require.NoError(t, sendCmd(s, "done"))
	m = next(t, got, "result", func(m *nodev1.ConnectRequest) bool { return m.GetCommandResult() != nil })
	require.Equal(t, "ran done", string(m.GetCommandResult().GetOutput()))
	require.NoError(t, sendCancel(s, "done"))
	m = next(t, got, "re-sent result", func(m *nodev1.ConnectRequest) bool { return m.GetCommandResult() != nil })
	require.Equal(t, "done/1", m.GetCommandResult().GetResultId())
	m = next(t, got, "ack", func(m *nodev1.ConnectRequest) bool { return m.GetCancelAck() != nil })
	require.Equal(t, nodev1.CancelOutcome_CANCEL_OUTCOME_ALREADY_FINISHED, m.GetCancelAck().GetOutcome())
}

// TestOutputPiecesAndCap: a large write is cut into 64 KiB pieces, and
// nothing past MaxOutputBytes is sent; Stdout of a ctx that is no Handler's
// discards.
func TestOutputPiecesAndCap(t *testing.T) {
	t.Parallel()
	_, err := Stdout(context.Background()).Write([]byte("x"))
	require.NoError(t, err)
	var sent []*nodev1.CommandOutput
	// A fake clock never advanced: only a full piece or close sends.
	o := &output{id: "c", limit: 100 << 10, every: time.Hour, clock: clockwork.NewFakeClock(), send: func(m *nodev1.ConnectRequest) {
		sent = append(sent, m.GetCommandOutput())
	}}
	big := strings.Repeat("a", 150<<10)
	o.write(nodev1.OutputStream_OUTPUT_STREAM_STDOUT, []byte(big))
	o.close()
	require.Len(t, sent, 2)
	require.EqualValues(t, 0, sent[0].GetOffset())
	require.Len(t, sent[0].GetData(), outputPieceBytes)
	require.EqualValues(t, outputPieceBytes, sent[1].GetOffset())
	require.Len(t, sent[1].GetData(), 100<<10-outputPieceBytes, "nothing past the cap")
	o.write(nodev1.OutputStream_OUTPUT_STREAM_STDOUT, []byte("late"))
	require.Len(t, sent, 2, "nothing after close")
}
