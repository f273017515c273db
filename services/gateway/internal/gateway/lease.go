package gateway

// The gateway lease: the keeper's callbacks that fence the gateway when the
// lease is lost and resume serving when it is taken again, and the fenced
// transactions every routing write runs in.

import (
	"context"
	"errors"
	"fmt"

	"connectrpc.com/connect"
	"connectrpc.com/grpchealth"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1/nodev1connect"
	"github.com/leasehold/leasehold/pkg/health"
)

// keeperConns is the size of the keeper's own pool: one renewal at a time,
// plus one for a release or a take racing it.
const keeperConns = 2

// newKeeperPool is the keeper's own small pool, on the same URL and settings
// as db (a copy of its configuration: pooler mode, tracer, application
// name). The lease's take and renewal run on it, never on the shared pool,
// so they cannot queue for a connection behind a Hello herd, dispatch or
// ingest; fenced transactions stay on the shared pool. It connects lazily
// and is closed when the gateway stops (running's exit, or a failed start).
func newKeeperPool(db *pgxpool.Pool) (*pgxpool.Pool, error) {
	cfg := db.Config().Copy()
	cfg.MaxConns, cfg.MinConns = keeperConns, 0
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		return nil, fmt.Errorf("gateway lease pool: %w", err)
	}
	return p, nil
}

func (g *Gateway) stopKeeper() {
	if g.keeperStop != nil {
		g.keeperStop()
		<-g.keeperDone
	}
}

// fence is the self-fence: refuse Hellos, close every stream UNAVAILABLE,
// answer not ready. It writes nothing to the database. The keeper has
// already dropped the lease (it calls fence through OnLost) and goes on
// taking it again; leaseTaken resumes serving.
func (g *Gateway) fence(reason string) {
	g.fenceMu.Lock()
	defer g.fenceMu.Unlock()
	if g.Fenced() {
		return
	}
	g.generation.Add(1)
	g.fenceReason = reason
	g.state.Store(stateFenced)
	g.m.role.Set(health.RoleFenced)
	g.m.selfFences.Inc()
	g.checker.SetStatus(nodev1connect.NodeGatewayServiceName, grpchealth.StatusNotServing)
	g.checker.SetStatus("", grpchealth.StatusNotServing)
	g.log.Error("gateway fenced itself: closing every stream; it serves again once it holds its lease at a new epoch",
		"reason", reason, "lease", g.keeper.Name())
	for _, s := range g.snapshot() {
		s.close(connect.NewError(connect.CodeUnavailable, fmt.Errorf("gateway %s fenced itself: %s", g.id, reason)))
	}
	close(g.fencedCh)
}

// leaseTaken is the keeper's OnAcquired: at start nothing happens (starting
// goes on); after a fence the gateway serves again, but only at an epoch
// newer than the one it last served at. The keeper signals Acquired before
// it calls OnAcquired, so the first take's call can arrive after starting
// and even after a fence; at the old epoch it must not resume serving.
func (g *Gateway) leaseTaken(l coord.Lease) {
	g.fenceMu.Lock()
	defer g.fenceMu.Unlock()
	if !g.Fenced() || g.stopping.Load() || l.Epoch <= g.servedEpoch {
		return
	}
	g.servedEpoch = l.Epoch
	g.fencedCh = make(chan struct{})
	g.state.Store(stateServing)
	g.m.role.Set(health.RoleActive)
	g.checker.SetStatus(nodev1connect.NodeGatewayServiceName, grpchealth.StatusServing)
	g.checker.SetStatus("", grpchealth.StatusServing)
	g.log.Info("gateway serving again", "lease", l.Name, "epoch", l.Epoch, "fenced_for", g.fenceReason)
	g.wakeDispatch("")
}

// fenced returns a channel closed at the next fence.
func (g *Gateway) fenced() <-chan struct{} {
	g.fenceMu.Lock()
	defer g.fenceMu.Unlock()
	return g.fencedCh
}

// runFenced runs fn fenced on the gateway lease; a fence that finds the
// lease lost fences the gateway (through the keeper's OnLost).
func (g *Gateway) runFenced(ctx context.Context, fn func(ctx context.Context, tx pgxTx) error) error {
	err := g.keeper.RunFenced(ctx, g.db, fn)
	if errors.Is(err, coord.ErrLeaseLost) {
		g.m.fenceFailures.Inc()
	}
	if err != nil {
		return fmt.Errorf("fenced on %s: %w", g.keeper.Name(), err)
	}
	return nil
}
