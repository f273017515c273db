package gateway

// Drain: on SIGTERM every node is told to reconnect elsewhere after a random
// delay, and the gateway waits for its streams to go.

import (
	"context"
	"errors"
	"math/rand/v2"
	"time"

	"connectrpc.com/connect"
	"connectrpc.com/grpchealth"
	"google.golang.org/protobuf/types/known/durationpb"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1/nodev1connect"
)

// drain sends every node Drain with a random delay up to DrainMaxDelay,
// stops accepting streams, and returns when the streams are gone or
// DrainMaxDelay + DrainGrace has passed (then closes the rest).
func (g *Gateway) drain(serveErr <-chan error) {
	if !g.state.CompareAndSwap(stateServing, stateDraining) {
		_ = g.srv.Close()
		return
	}
	g.checker.SetStatus(nodev1connect.NodeGatewayServiceName, grpchealth.StatusNotServing)
	g.checker.SetStatus("", grpchealth.StatusNotServing)
	sessions := g.snapshot()
	g.log.Info("draining", "sessions", len(sessions), "max_delay", g.cfg.DrainMaxDelay)
	for _, s := range sessions {
		s.enqueue(drainMessage(g.cfg.DrainMaxDelay))
	}
	deadline := g.clock.After(g.cfg.DrainMaxDelay + g.cfg.DrainGrace)
	shutdownCtx, cancel := context.WithCancel(context.Background())
	defer cancel()
	shutdownDone := make(chan struct{})
	go func() {
		// Closes the listener, sends GOAWAY, and waits for open streams.
		_ = g.srv.Shutdown(shutdownCtx)
		close(shutdownDone)
	}()
	tick := g.clock.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	fenced := g.fenced()
wait:
	for g.streams.Load() > 0 || g.SessionCount() > 0 {
		select {
		case <-deadline:
			break wait
		case <-fenced:
			break wait
		case <-tick.Chan():
		}
	}
	left := g.snapshot()
	if len(left) > 0 {
		g.log.Warn("drain deadline passed; closing remaining streams", "sessions", len(left))
	}
	for _, s := range left {
		s.close(connect.NewError(connect.CodeUnavailable, errors.New("gateway drained")))
	}
	cancel()
	<-shutdownDone
	_ = g.srv.Close()
	<-serveErr // after Close, Serve returns ErrServerClosed
	g.log.Info("drained")
}

func drainMessage(maxDelay time.Duration) *nodev1.ConnectResponse {
	var d time.Duration
	if maxDelay > 0 {
		d = rand.N(maxDelay + 1)
	}
	return &nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Drain{Drain: &nodev1.Drain{
		Delay: durationpb.New(d), Reason: "gateway shutting down",
	}}}
}
