// Package agent is leasehold-node: the program on every machine of a fleet
// (docs/node.md). It keeps the machine's session with a gateway through
// pkg/daemon, executes the typed command kinds through pkg/nodeexec,
// journals every command on disk so none runs twice across its own
// restart, and serves tunnels to the ports and shell its configuration
// allows.
package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/jonboulle/clockwork"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/leasehold/leasehold/pkg/daemon"
	"github.com/leasehold/leasehold/pkg/health"
	"github.com/leasehold/leasehold/pkg/nodeexec"
	"github.com/leasehold/leasehold/pkg/reload"
)

// Deps are the agent's collaborators.
type Deps struct {
	Logger   *slog.Logger
	Registry prometheus.Registerer
	Health   *health.Handler
	Clock    clockwork.Clock
	Version  string
}

// Agent is a running leasehold-node, a dskit service.
type Agent struct {
	services.Service
	cfg     Config
	log     *slog.Logger
	journal *daemon.FileJournal
	tls     *reload.ClientTLS
	d       *daemon.Daemon
	ex      *nodeexec.Executor
}

// New opens the state directory and the journal, checks the credential
// file, and builds the session; Run (through the service) connects.
func New(cfg Config, deps Deps) (*Agent, error) {
	if deps.Logger == nil {
		deps.Logger = slog.New(slog.DiscardHandler)
	}
	if deps.Clock == nil {
		deps.Clock = clockwork.NewRealClock()
	}
	if err := ensureStateDir(cfg.StateDir); err != nil {
		return nil, err
	}
	a := &Agent{cfg: cfg, log: deps.Logger}
	dcfg := daemon.Config{
		Address: cfg.GatewayURL, NodeID: cfg.NodeID,
		CredentialFunc: func() (string, error) { return ReadCredential(cfg.CredentialFile) },
		Labels:         cfg.Labels, Version: deps.Version,
		BackoffBase: min(time.Second, cfg.BackoffMax), BackoffMax: cfg.BackoffMax,
		MaxMessageBytes: cfg.MaxMessageBytes, MaxOutputBytes: cfg.MaxOutputBytes,
		TunnelPorts: cfg.TunnelPorts, TunnelShellUser: cfg.TunnelShellUser,
		Clock: deps.Clock, Logger: deps.Logger.With("component", "session"),
	}
	if s := strings.Fields(cfg.TunnelShell); len(s) > 0 {
		dcfg.TunnelShell = s
	}
	if strings.HasPrefix(cfg.GatewayURL, "https://") {
		t, err := reload.NewNodeClientTLS("node", cfg.TLS, cfg.NodeID, reload.Options{Logger: deps.Logger, Registerer: deps.Registry, Clock: deps.Clock})
		if err != nil {
			return nil, fmt.Errorf("--tls.cert-file and --node-id: %w", err)
		}
		a.tls = t
		dcfg.TLS = t.Config()
	}
	ex, err := nodeexec.New(cfg.Exec, deps.Logger.With("component", "exec"))
	if err != nil {
		return nil, err
	}
	a.ex = ex
	dcfg.Handler = ex.Handle
	if a.journal, err = daemon.OpenFileJournal(cfg.StateDir + "/" + journalFileName); err != nil {
		if errors.Is(err, daemon.ErrJournalLocked) {
			return nil, fmt.Errorf("--state-dir %s: another leasehold-node uses it (each agent needs a state directory of its own): %w", cfg.StateDir, err)
		}
		return nil, fmt.Errorf("--state-dir %s: %w", cfg.StateDir, err)
	}
	dcfg.Journal = a.journal
	if a.d, err = daemon.New(dcfg); err != nil {
		_ = a.journal.Close()
		return nil, err
	}
	if deps.Health != nil {
		deps.Health.AddReadiness("session", func(context.Context) error {
			if a.d.Welcome() == nil {
				return errors.New("no session with a gateway")
			}
			return nil
		})
		deps.Health.AddDetail("node", func(context.Context) any { return a.detail() })
	}
	a.Service = services.NewBasicService(nil, a.running, nil).WithName("node")
	return a, nil
}

// Daemon is the agent's session, for tests and the health detail.
func (a *Agent) Daemon() *daemon.Daemon { return a.d }

func (a *Agent) detail() any {
	st := a.d.Stats()
	w := a.d.Welcome()
	d := map[string]any{"node_id": a.cfg.NodeID, "connected": w != nil, "executions": st.Executions,
		"replays": st.Replays, "dials": st.Dials, "welcomes": st.Welcomes, "tunnels_opened": st.TunnelsOpened}
	if w != nil {
		d["gateway_id"] = w.GetGatewayId()
		d["session_epoch"] = w.GetSessionEpoch()
	}
	return d
}

func (a *Agent) running(ctx context.Context) error {
	a.log.Info("leasehold-node starting", "node", a.cfg.NodeID, "gateway", a.cfg.GatewayURL, "state_dir", a.cfg.StateDir)
	var wg sync.WaitGroup
	if a.tls != nil && a.tls.Watcher != nil {
		wg.Go(func() { a.tls.Run(ctx, reload.DefaultInterval) })
	}
	err := a.d.Run(ctx) // returns once ctx ends and every command has returned
	wg.Wait()
	a.ex.Close() // a reboot not yet started does not start
	return errors.Join(err, a.journal.Close())
}
