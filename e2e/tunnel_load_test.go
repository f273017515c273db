package e2e

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/leasehold/leasehold/pkg/daemon"
	"github.com/leasehold/leasehold/pkg/fleettest"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

// TestTunnelDrainWithCommands pushes 64 MiB from a node through a tunnel,
// read as fast as the caller can, while commands keep being created and
// completed on the same node: the tunnel's bytes and the session share
// one HTTP/2 connection, and the session must keep its heartbeats (its
// epoch does not move, the daemon is welcomed once) and complete every
// command within seconds.
func TestTunnelDrainWithCommands(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("moves 64 MiB through daemon, gateway and api; runs in the full suite")
	}
	db := pgtest.NewDB(t)
	ids, creds := fleettest.RegisterNodes(t, db.Pool, "drain", 1)
	tokenFile := filepath.Join(t.TempDir(), "relay-token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(tunnelRelayToken+"\n"), 0o600))
	env := []string{"LEASEHOLD_API_TOKENS=tunnel:" + tunnelToken + ",operator:" + tunnelOperator}
	start := func(service, name string, extra ...string) *proctest.Proc {
		args := append([]string{"--database-url", db.URL, "--http-addr", fleettest.Addr(t), "--id", name, "--log-format", "text"},
			fleettest.DBFlags(db.URL)...)
		p := proctest.Start(t, name, fleettest.Binary(t, service), env, append(args, extra...)...)
		p.WaitReady(60 * time.Second)
		return p
	}
	gwAddr := fleettest.Addr(t)
	start("gateway", "gw_drain", append([]string{"--listen-addr", gwAddr, "--gateway.relay-listen-addr", fleettest.Addr(t),
		"--gateway.relay-token-file", tokenFile, "--gateway.tunnel-idle-timeout", "30s"}, fleettest.FastGateway...)...)
	apiAddr := fleettest.Addr(t)
	start("api", "api_drain", "--listen-addr", apiAddr, "--api.relay-token-file", tokenFile)
	cc := controlv1connect.NewControlServiceClient(h2cClient(), "http://"+apiAddr)
	tun, op := controlClient{cc, tunnelToken}, controlClient{cc, tunnelOperator}

	var flooded atomic.Int64
	const total = 64 << 20
	floodPort := floodServer(t, total, &flooded)
	var executed atomic.Int64
	d, err := daemon.New(daemon.Config{Address: "http://" + gwAddr, NodeID: ids[0], Credential: creds[0],
		Handler: func(context.Context, *nodev1.Command) daemon.Outcome {
			executed.Add(1)
			return daemon.Outcome{Output: []byte("ok")}
		},
		BackoffBase: 50 * time.Millisecond, BackoffMax: 500 * time.Millisecond, TunnelPorts: []uint32{floodPort},
		// Why a session ended is logged at debug: it is what a failure
		// here needs.
		Logger: slog.New(slog.NewTextHandler(testLogWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	require.NoError(t, err)
	dctx, dcancel := context.WithCancel(context.Background())
	var dwg sync.WaitGroup
	dwg.Go(func() { _ = d.Run(dctx) })
	t.Cleanup(func() { dcancel(); dwg.Wait() })

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var st *tunnelStream
	for st == nil {
		s, _, err := openTunnel(ctx, tun, &controlv1.TunnelOpen{NodeId: ids[0], Target: portTarget(floodPort)})
		if err == nil {
			st = s
			break
		}
		require.NoError(t, ctx.Err(), "no tunnel: %v", err)
		time.Sleep(100 * time.Millisecond) // poll interval while the node connects
	}
	var epoch int64
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT session_epoch FROM node_sessions WHERE node_id = $1`, ids[0]).Scan(&epoch))

	// Commands, one after another, for as long as the drain runs.
	drained := make(chan struct{})
	type cmdRun struct {
		took  time.Duration
		state controlv1.CommandState
	}
	runs := make(chan []cmdRun, 1)
	go func() {
		var got []cmdRun
		defer func() { runs <- got }()
		for {
			select {
			case <-drained:
				return
			default:
			}
			started := time.Now()
			r, err := op.CreateCommand(ctx, authed(op, &controlv1.CreateCommandRequest{NodeId: ids[0], Kind: "noop"}))
			if err != nil {
				got = append(got, cmdRun{took: -1})
				return
			}
			id := r.Msg.GetCommand().GetId()
			var state controlv1.CommandState
			for state != controlv1.CommandState_COMMAND_STATE_SUCCEEDED && ctx.Err() == nil {
				w, err := op.WaitCommand(ctx, authed(op, &controlv1.WaitCommandRequest{CommandId: id, Timeout: durationpb.New(20 * time.Second)}))
				if err != nil {
					break
				}
				state = w.Msg.GetCommand().GetState()
				if state != controlv1.CommandState_COMMAND_STATE_SUCCEEDED && time.Since(started) > 30*time.Second {
					break
				}
			}
			got = append(got, cmdRun{took: time.Since(started), state: state})
		}
	}()

	drainStart := time.Now()
	got, err := roundTrip(st, nil)
	took := time.Since(drainStart)
	close(drained)
	_ = st.CloseResponse()
	require.NoError(t, err)
	require.Len(t, got, total)
	done := <-runs
	t.Logf("drained %d bytes in %s (%.1f MiB/s) while %d commands ran", total, took.Round(time.Millisecond),
		float64(total)/(1<<20)/took.Seconds(), len(done))

	// Every command in done was created while the drain ran (the loop
	// starts none after it); how many fit depends on how fast this machine
	// drains 64 MiB (0.6 s in one CI run: one command), so the test asks
	// for one and checks that none waited behind the tunnel.
	require.NotEmpty(t, done, "a command ran during the drain")
	var slowest time.Duration
	for i, r := range done {
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_SUCCEEDED, r.state, "command %d of %d (took %s)", i+1, len(done), r.took)
		slowest = max(slowest, r.took)
	}
	t.Logf("slowest command: %s", slowest)
	require.Less(t, slowest, 10*time.Second, "a command waited behind the tunnel")
	var now int64
	var state string
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT session_epoch, state FROM node_sessions WHERE node_id = $1`, ids[0]).Scan(&now, &state))
	require.Equal(t, epoch, now, "the node's session was replaced during the drain")
	require.Equal(t, "connected", state)
	require.Equal(t, int64(1), d.Stats().Welcomes, "the daemon kept its first session")
}

// testLogWriter writes each log line to the test's log.
type testLogWriter struct{ t *testing.T }

func (w testLogWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
