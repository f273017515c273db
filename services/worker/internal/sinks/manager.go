package sinks

import (
	"context"
	"log/slog"
	"net/http"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leasehold/leasehold/pkg/egress"
	"github.com/leasehold/leasehold/pkg/reconcile"
)

const leasePrefix = "singleton:sink:"

// Manager keeps the runtime's sink jobs in step with the sinks table: a new
// sink starts being taken within one refresh, a deleted one is stopped and
// its lease released. Every worker runs a Manager; the leases decide which
// worker delivers each sink.
type Manager struct {
	*services.BasicService
	db      *pgxpool.Pool
	rt      *reconcile.Runtime
	logger  *slog.Logger
	refresh time.Duration
	client  *http.Client
	running map[string]Webhook
}

// DeliveryTimeout bounds one POST to a sink.
const DeliveryTimeout = 10 * time.Second

// NewManager returns a manager refreshing every refresh; every delivery
// dials through policy.
func NewManager(db *pgxpool.Pool, rt *reconcile.Runtime, logger *slog.Logger, refresh time.Duration, policy egress.Policy) *Manager {
	m := &Manager{db: db, rt: rt, logger: logger, refresh: refresh, client: policy.Client(DeliveryTimeout), running: map[string]Webhook{}}
	m.BasicService = services.NewTimerService(refresh, m.sync, m.iterate, nil).WithName("sinks")
	return m
}

func (m *Manager) sync(ctx context.Context) error {
	_ = m.iterate(ctx) // a database hiccup at start is retried on the next tick
	return nil
}

func (m *Manager) iterate(ctx context.Context) error {
	if err := m.rt.AwaitRunning(ctx); err != nil {
		return nil
	}
	hooks, err := Load(ctx, m.db)
	if err != nil {
		m.logger.Warn("refresh sinks", "err", err)
		return nil
	}
	want := map[string]Webhook{}
	for _, h := range hooks {
		h.Client = m.client
		want[h.ID] = h
	}
	for id, h := range want {
		if old, ok := m.running[id]; ok && old == h {
			continue
		}
		if _, ok := m.running[id]; ok { // changed URL or secret: restart
			_ = m.rt.RemoveJob(ctx, leasePrefix+id)
		}
		if err := m.rt.RegisterSink(h.Sink()); err != nil {
			m.logger.Warn("start sink", "sink", id, "err", err)
			continue
		}
		m.running[id] = h
		m.logger.Info("sink configured", "sink", id, "url", egress.RedactURL(h.URL))
	}
	for id := range m.running {
		if _, ok := want[id]; !ok {
			if err := m.rt.RemoveJob(ctx, leasePrefix+id); err != nil {
				m.logger.Warn("stop sink", "sink", id, "err", err)
			}
			delete(m.running, id)
			m.logger.Info("sink removed", "sink", id)
		}
	}
	return nil
}
