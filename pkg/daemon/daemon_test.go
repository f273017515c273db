package daemon

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jonboulle/clockwork"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/leasehold/leasehold/pkg/buildinfo"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1/nodev1connect"
)

type stream = connect.BidiStream[nodev1.ConnectRequest, nodev1.ConnectResponse]

// fakeGateway runs script for every stream, numbered from 1.
type fakeGateway struct {
	nodev1connect.UnimplementedNodeGatewayServiceHandler
	dials  atomic.Int64
	script func(n int64, ctx context.Context, s *stream) error
	// tunnel serves Tunnel streams when set.
	tunnel func(ctx context.Context, s *connect.BidiStream[nodev1.TunnelRequest, nodev1.TunnelResponse]) error
}

func (f *fakeGateway) Tunnel(ctx context.Context, s *connect.BidiStream[nodev1.TunnelRequest, nodev1.TunnelResponse]) error {
	if f.tunnel == nil {
		return connect.NewError(connect.CodeUnimplemented, errors.New("no tunnels"))
	}
	return f.tunnel(ctx, s)
}

func (f *fakeGateway) Connect(ctx context.Context, s *stream) error {
	return f.script(f.dials.Add(1), ctx, s)
}

func startFake(t *testing.T, f *fakeGateway) string {
	t.Helper()
	mux := http.NewServeMux()
	mux.Handle(nodev1connect.NewNodeGatewayServiceHandler(f))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	return srv.URL
}

func welcome(s *stream) error {
	if _, err := s.Receive(); err != nil {
		return err
	}
	return s.Send(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Welcome{Welcome: &nodev1.Welcome{
		SessionEpoch: 1, HeartbeatInterval: durationpb.New(time.Hour),
	}}})
}

func drainUntilDone(ctx context.Context, s *stream) error {
	for {
		if _, err := s.Receive(); err != nil {
			return nil
		}
		if ctx.Err() != nil {
			return nil
		}
	}
}

func TestBackoffFullJitterBounds(t *testing.T) {
	t.Parallel()
	b := Backoff{Base: time.Second, Max: 60 * time.Second, Rand: func() float64 { return 0.999999 }}
	var got []time.Duration
	for range 9 {
		got = append(got, b.Next().Round(time.Second))
	}
	require.Equal(t, []time.Duration{1, 2, 4, 8, 16, 32, 60, 60, 60}, secs(got))
	b.Reset()
	require.Equal(t, time.Second, b.Bound())
	b.Rand = func() float64 { return 0 }
	require.Zero(t, b.Next())

	r := Backoff{Base: time.Second, Max: 60 * time.Second}
	for range 1000 {
		bound := r.Bound()
		d := r.Next()
		require.GreaterOrEqual(t, d, time.Duration(0))
		require.LessOrEqual(t, d, bound)
	}
}

func secs(ds []time.Duration) []time.Duration {
	out := make([]time.Duration, len(ds))
	for i, d := range ds {
		out[i] = d / time.Second
	}
	return out
}

func TestPushbackRetryAfterIsHonoured(t *testing.T) {
	t.Parallel()
	f := &fakeGateway{script: func(n int64, ctx context.Context, s *stream) error {
		if n == 1 {
			_, _ = s.Receive()
			_ = s.Send(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Pushback{Pushback: &nodev1.Pushback{
				RetryAfter: durationpb.New(30 * time.Second), Reason: "hello-rate"}}})
			return connect.NewError(connect.CodeResourceExhausted, errors.New("admission refused"))
		}
		if err := welcome(s); err != nil {
			return err
		}
		return drainUntilDone(ctx, s)
	}}
	addr := startFake(t, f)
	clock := clockwork.NewFakeClock()
	d, err := New(Config{Address: addr, NodeID: "n1", Credential: "c", Handler: func(context.Context, *nodev1.Command) Outcome { return Outcome{} },
		Clock: clock, BackoffBase: time.Millisecond, BackoffMax: time.Millisecond})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = d.Run(ctx) }()
	defer func() { cancel(); <-done }()

	require.Eventually(t, func() bool { return d.Stats().Pushbacks == 1 }, 5*time.Second, time.Millisecond)
	require.NoError(t, clock.BlockUntilContext(ctx, 1)) // waiting out retry_after
	clock.Advance(29 * time.Second)
	// Still waiting on the clock, not dialling: a timer fired early would
	// leave no waiter until the redial's own.
	require.NoError(t, clock.BlockUntilContext(ctx, 1))
	require.EqualValues(t, 1, f.dials.Load(), "no redial before retry_after")
	clock.Advance(time.Second)
	require.Eventually(t, func() bool { return d.Stats().Welcomes == 1 }, 5*time.Second, time.Millisecond)
	require.EqualValues(t, 2, f.dials.Load())
}

// TestPushbackResetsTheBackoff: failures grow the back-off, a Pushback
// replaces it with the gateway's retry_after and restarts it from its
// base, so a fleet refused while its gateways were fenced (a database
// outage) returns when told, not after a back-off grown towards a minute.
func TestPushbackResetsTheBackoff(t *testing.T) {
	t.Parallel()
	f := &fakeGateway{script: func(n int64, ctx context.Context, s *stream) error {
		_, _ = s.Receive()
		switch {
		case n <= 6, n == 8:
			return connect.NewError(connect.CodeUnavailable, errors.New("gateway not serving"))
		case n == 7:
			_ = s.Send(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Pushback{Pushback: &nodev1.Pushback{
				RetryAfter: durationpb.New(2 * time.Second), Reason: "not-serving"}}})
			return connect.NewError(connect.CodeUnavailable, errors.New("not serving"))
		}
		if err := s.Send(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Welcome{Welcome: &nodev1.Welcome{
			SessionEpoch: 1, HeartbeatInterval: durationpb.New(time.Hour)}}}); err != nil {
			return err
		}
		return drainUntilDone(ctx, s)
	}}
	addr := startFake(t, f)
	clock := clockwork.NewFakeClock()
	var jitter atomic.Value // float64: 0 while the failures grow the bound
	jitter.Store(0.0)
	d, err := New(Config{Address: addr, NodeID: "n1", Credential: "c", Handler: func(context.Context, *nodev1.Command) Outcome { return Outcome{} },
		Clock: clock, BackoffBase: time.Second, BackoffMax: time.Minute, Rand: func() float64 { return jitter.Load().(float64) }})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = d.Run(ctx) }()
	defer func() { cancel(); <-done }()

	// Six failures double the bound to a minute (each wait drawn as 0).
	require.Eventually(t, func() bool { return d.Stats().Pushbacks == 1 }, 10*time.Second, time.Millisecond)
	require.EqualValues(t, 7, f.dials.Load())
	jitter.Store(0.999)
	require.NoError(t, clock.BlockUntilContext(ctx, 1)) // waiting out retry_after
	clock.Advance(2 * time.Second)
	require.Eventually(t, func() bool { return f.dials.Load() == 8 }, 5*time.Second, time.Millisecond)
	// The failure after the pushback waits under the base (0.999 s), not
	// under the grown bound (a minute): simulated time moves in small
	// steps, and the redial comes within 5 simulated seconds.
	var advanced time.Duration
	for d.Stats().Welcomes == 0 && advanced < 5*time.Second {
		require.NoError(t, clock.BlockUntilContext(ctx, 1))
		clock.Advance(50 * time.Millisecond)
		advanced += 50 * time.Millisecond
		time.Sleep(time.Millisecond) // lets the daemon's goroutine run between steps
	}
	require.Eventually(t, func() bool { return d.Stats().Welcomes == 1 }, 5*time.Second, time.Millisecond,
		"no redial within %s of simulated time after the pushback", advanced)
	require.EqualValues(t, 9, f.dials.Load())
}

func TestDrainDelayIsHonoured(t *testing.T) {
	t.Parallel()
	f := &fakeGateway{script: func(n int64, ctx context.Context, s *stream) error {
		if err := welcome(s); err != nil {
			return err
		}
		if n == 1 {
			_ = s.Send(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Drain{Drain: &nodev1.Drain{Delay: durationpb.New(10 * time.Second)}}})
		}
		return drainUntilDone(ctx, s)
	}}
	addr := startFake(t, f)
	clock := clockwork.NewFakeClock()
	d, err := New(Config{Address: addr, NodeID: "n1", Credential: "c", Handler: func(context.Context, *nodev1.Command) Outcome { return Outcome{} }, Clock: clock})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = d.Run(ctx) }()
	defer func() { cancel(); <-done }()

	require.Eventually(t, func() bool { return d.Stats().Drains == 1 }, 5*time.Second, time.Millisecond)
	require.NoError(t, clock.BlockUntilContext(ctx, 1)) // waiting out the drain delay
	clock.Advance(9 * time.Second)
	require.NoError(t, clock.BlockUntilContext(ctx, 1)) // still waiting on the clock
	require.EqualValues(t, 1, f.dials.Load(), "the stream is kept for the drain delay")
	clock.Advance(time.Second)
	require.Eventually(t, func() bool { return d.Stats().Welcomes == 2 }, 5*time.Second, time.Millisecond)
}

// TestFileJournalDedupsReplayAcrossRestart: the gateway replays the same
// command on every session; the daemon runs it once, and a restarted daemon
// (same journal file) re-sends the stored result instead of running it.
func TestFileJournalDedupsReplayAcrossRestart(t *testing.T) {
	t.Parallel()
	results := make(chan *nodev1.CommandResult, 10)
	f := &fakeGateway{script: func(n int64, ctx context.Context, s *stream) error {
		if err := welcome(s); err != nil {
			return err
		}
		_ = s.Send(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Command{Command: &nodev1.Command{CommandId: "c1", Kind: "exec", DispatchCount: int32(n)}}})
		for {
			m, err := s.Receive()
			if err != nil {
				return nil
			}
			if r := m.GetCommandResult(); r != nil {
				results <- r
			}
		}
	}}
	addr := startFake(t, f)
	path := filepath.Join(t.TempDir(), "journal.jsonl")
	var executions atomic.Int64
	run := func() {
		j, err := OpenFileJournal(path)
		require.NoError(t, err)
		defer j.Close()
		d, err := New(Config{Address: addr, NodeID: "n1", Credential: "c", Journal: j,
			Handler: func(context.Context, *nodev1.Command) Outcome {
				executions.Add(1)
				return Outcome{Output: []byte("done")}
			}})
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); _ = d.Run(ctx) }()
		select {
		case r := <-results:
			require.Equal(t, "c1/1", r.GetResultId())
			require.Equal(t, []byte("done"), r.GetOutput())
		case <-time.After(10 * time.Second):
			t.Fatal("no result")
		}
		cancel()
		<-done
	}
	run()
	run() // restart: replayed, not re-run
	require.EqualValues(t, 1, executions.Load())
}

func TestFileJournalInterruptedCommandIsNotRerun(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "journal.jsonl")
	j, err := OpenFileJournal(path)
	require.NoError(t, err)
	require.NoError(t, j.Record("started-only", nil))
	require.NoError(t, j.Record("done", &nodev1.CommandResult{CommandId: "done", ResultId: "done/1"}))
	require.NoError(t, j.Close())
	// A torn line from a crash mid-write is ignored.
	fh, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	require.NoError(t, err)
	_, _ = fh.WriteString(`{"c":"torn","r":{"comm`)
	require.NoError(t, fh.Close())

	j, err = OpenFileJournal(path)
	require.NoError(t, err)
	defer j.Close()
	require.Equal(t, []string{"started-only"}, j.InFlight())
	r, executed := j.Seen("done")
	require.True(t, executed)
	require.Equal(t, "done/1", r.GetResultId())
	_, executed = j.Seen("torn")
	require.False(t, executed)

	var mu sync.Mutex
	var sent []*nodev1.CommandResult
	d := &Daemon{cfg: Config{Journal: j, Handler: func(context.Context, *nodev1.Command) Outcome {
		t.Fatal("an interrupted command must not run again")
		return Outcome{}
	}}, clock: clockwork.NewRealClock(), running: map[string]*execution{}, stopped: map[string]bool{}}
	d.log = discardLogger()
	d.handleCommand(context.Background(), &nodev1.Command{CommandId: "started-only"})
	mu.Lock()
	defer mu.Unlock()
	r, _ = j.Seen("started-only")
	require.Equal(t, "started-only/interrupted", r.GetResultId())
	require.Empty(t, sent)
}

// TestHelloCarriesTheBuildVersion: a daemon configured without a version
// reports the build's (pkg/buildinfo) in Hello.daemon_version, which the
// gateway stores on the node; a configured one wins.
func TestHelloCarriesTheBuildVersion(t *testing.T) {
	t.Parallel()
	for _, configured := range []string{"", "custom-1.0"} {
		hellos := make(chan *nodev1.Hello, 1)
		f := &fakeGateway{script: func(n int64, ctx context.Context, s *stream) error {
			m, err := s.Receive()
			if err != nil {
				return err
			}
			select {
			case hellos <- m.GetHello():
			default:
			}
			<-ctx.Done()
			return nil
		}}
		addr := startFake(t, f)
		d, err := New(Config{Address: addr, NodeID: "n1", Credential: "c", Version: configured,
			Handler: func(context.Context, *nodev1.Command) Outcome { return Outcome{} }})
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); _ = d.Run(ctx) }()
		var h *nodev1.Hello
		select {
		case h = <-hellos:
		case <-time.After(30 * time.Second):
			t.Fatal("no Hello")
		}
		cancel()
		<-done
		want := configured
		if want == "" {
			want = buildinfo.Version()
		}
		require.Equal(t, want, h.GetDaemonVersion())
		require.NotEmpty(t, h.GetDaemonVersion())
	}
}
