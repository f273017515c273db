// Package fleet starts a whole leasehold control plane for the benches:
// PostgreSQL, N gateways behind HAProxy, a worker, a scheduler and the api,
// all real processes, plus simulated node daemons (pkg/daemon) that each
// hold their own TCP connection through the balancer.
package fleet

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"connectrpc.com/connect"

	"github.com/leasehold/leasehold/bench/internal/harness"
	"github.com/leasehold/leasehold/pkg/clock"
	"github.com/leasehold/leasehold/pkg/cmdwake"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
)

// Timings selects the services' durations.
type Timings string

// Real uses the production defaults (gateway lease 20 s / 5 s, session lease
// 40 s, shard TTL 15 s / 5 s); Fast shortens them about tenfold.
const (
	Real Timings = "real"
	Fast Timings = "fast"
)

// GatewayArgs are the gateway flags of a timing mode.
func (t Timings) GatewayArgs() []string {
	if t == Fast {
		return []string{"--gateway.lease-ttl", "2s", "--gateway.lease-renew", "500ms", "--gateway.session-lease", "6s",
			"--gateway.liveness-interval", "200ms", "--gateway.heartbeat-interval", "1s", "--gateway.dispatch-poll", "200ms"}
	}
	return nil
}

// CoordArgs are the worker/scheduler flags of a timing mode.
func (t Timings) CoordArgs() []string {
	if t == Fast {
		return []string{"--coord.lease-ttl", "3s", "--coord.renew-interval", "1s", "--coord.live-window", "6s",
			"--coord.statement-timeout", "1s", "--coord.self-release-after", "5s", "--coord.poll-interval", "50ms",
			"--coord.claim-ttl", "5s"}
	}
	return nil
}

// Options configures Start.
type Options struct {
	Gateways    int
	Timings     Timings
	GatewayArgs []string // extra gateway flags
	WorkerArgs  []string // extra worker flags
	APIArgs     []string // extra api flags
	NoAPI       bool
	MaxConns    int // balancer connection limit
	// Scale, when its Rate is above 1, runs every service and the
	// database's compute_now() on one scaled clock (pkg/clock).
	Scale   clock.Scale
	BinDir  string
	Durable bool
	// Server, when set, is used (and left running) instead of a new one.
	Server *harness.Server
	// ServiceURL, when set, maps the fresh database's name to the URL the
	// services get (e.g. a multi-host URL over a primary and its standby);
	// default: the database's URL on Server.
	ServiceURL func(db string) string
	Log        func(format string, args ...any)
}

// Gateway is one gateway process.
type Gateway struct {
	Name         string
	Listen, HTTP string
	Proc         *harness.Proc
}

// Fleet is a running control plane.
type Fleet struct {
	Dir      string
	Sup      *harness.Supervisor
	Server   *harness.Server
	DB       *harness.Database
	Bins     map[string]string
	Gateways []*Gateway
	Worker   *harness.Proc
	Sched    *harness.Proc
	API      *harness.Proc
	APIAddr  string
	Token    string
	LBAddr   string
	HAProxy  []*harness.Proc // one per fdsPerProcess/2 connections
	opts     Options
}

// Start builds and starts everything. Close stops it all, also after an error.
func Start(ctx context.Context, o Options) (*Fleet, error) {
	if o.Log == nil {
		o.Log = func(string, ...any) {}
	}
	if o.MaxConns == 0 {
		o.MaxConns = 20000
	}
	f := &Fleet{opts: o, Sup: &harness.Supervisor{}}
	var err error
	if f.Dir, err = os.MkdirTemp("", "leasehold-bench-"); err != nil {
		return f, err
	}
	f.Sup.LogDir = f.Dir
	o.Log("building services into %s", f.Dir)
	services := []string{"gateway", "worker", "scheduler", "api"}
	if o.NoAPI {
		services = services[:3]
	}
	if f.Bins, err = harness.Binaries(f.Dir, o.BinDir, services...); err != nil {
		return f, err
	}
	if f.Server = o.Server; f.Server == nil {
		o.Log("starting PostgreSQL")
		if f.Server, err = harness.StartServer(ctx, o.Durable); err != nil {
			return f, err
		}
	}
	if f.DB, err = f.Server.CreateDatabase(ctx, "bench"); err != nil {
		return f, err
	}
	if o.Scale.Rate > 1 {
		if err := clock.InstallSQL(ctx, f.DB.Pool, o.Scale); err != nil {
			return f, err
		}
	}
	coord := o.Timings.CoordArgs()
	if f.Worker, err = f.service(ctx, "worker", "worker-1", append(append([]string{}, coord...), o.WorkerArgs...)...); err != nil {
		return f, err
	}
	if f.Sched, err = f.service(ctx, "scheduler", "scheduler-1", coord...); err != nil {
		return f, err
	}
	if !o.NoAPI {
		b := make([]byte, 16)
		_, _ = rand.Read(b)
		f.Token = hex.EncodeToString(b)
		tokens := filepath.Join(f.Dir, "tokens")
		if err := os.WriteFile(tokens, []byte("admin:"+f.Token+"\n"), 0o600); err != nil {
			return f, err
		}
		f.APIAddr = harness.FreeAddr()
		// The benches are the one caller and measure throughput: no
		// per-token rate limit.
		args := append([]string{"--listen-addr", f.APIAddr, "--tokens-file", tokens,
			"--api.default-command-timeout", "24h", "--api.rate-limit", "0"}, o.APIArgs...)
		if f.API, err = f.service(ctx, "api", "api-1", args...); err != nil {
			return f, fmt.Errorf("%w (rerun with -producer sql to create commands without the api)", err)
		}
	}
	var backends []harness.Backend
	for i := range o.Gateways {
		g, err := f.StartGateway(ctx, fmt.Sprintf("gw-%d", i+1))
		if err != nil {
			return f, err
		}
		backends = append(backends, harness.Backend{Name: g.Name, Listen: g.Listen, HTTP: g.HTTP})
	}
	if f.LBAddr, f.HAProxy, err = harness.StartHAProxy(ctx, f.Sup, f.Dir, backends, o.MaxConns, o.Scale.Rate); err != nil {
		return f, err
	}
	o.Log("control plane up: %d gateways behind HAProxy %s, worker, scheduler%s", o.Gateways, f.LBAddr,
		map[bool]string{false: ", api", true: ""}[o.NoAPI])
	return f, nil
}

// StartService starts one more service process (worker, scheduler, api)
// named name on the fleet's database and waits until it is ready.
func (f *Fleet) StartService(ctx context.Context, service, name string, extra ...string) (*harness.Proc, error) {
	return f.service(ctx, service, name, extra...)
}

// ServiceURL is the database URL the services were given.
func (f *Fleet) ServiceURL() string {
	if f.opts.ServiceURL != nil {
		return f.opts.ServiceURL(f.DB.Name)
	}
	return f.DB.URL
}

func (f *Fleet) service(ctx context.Context, service, name string, extra ...string) (*harness.Proc, error) {
	args := append([]string{"--database-url", f.ServiceURL(), "--http-addr", harness.FreeAddr(), "--id", name,
		"--log-format", "text", "--log-level", "warn"}, f.ScaleArgs()...)
	args = append(args, extra...)
	p, err := f.Sup.Start(name, f.Bins[service], nil, args...)
	if err != nil {
		return nil, err
	}
	return p, p.WaitReady(ctx, 60*time.Second)
}

// StartGateway starts one more gateway (not behind the balancer unless it
// was in Start's set).
func (f *Fleet) StartGateway(ctx context.Context, name string) (*Gateway, error) {
	g := &Gateway{Name: name, Listen: harness.FreeAddr(), HTTP: harness.FreeAddr()}
	args := append([]string{"--database-url", f.ServiceURL(), "--http-addr", g.HTTP, "--listen-addr", g.Listen, "--id", name,
		"--log-format", "text", "--log-level", "warn"}, f.opts.Timings.GatewayArgs()...)
	args = append(args, f.ScaleArgs()...)
	args = append(args, f.opts.GatewayArgs...)
	p, err := f.Sup.Start(name, f.Bins["gateway"], nil, args...)
	if err != nil {
		return nil, err
	}
	g.Proc = p
	f.Gateways = append(f.Gateways, g)
	return g, p.WaitReady(ctx, 60*time.Second)
}

// ScaleArgs are the --clock.* flags of the fleet's scale (none when real).
func (f *Fleet) ScaleArgs() []string {
	if f.opts.Scale.Rate <= 1 {
		return nil
	}
	return []string{"--clock.rate", fmt.Sprint(f.opts.Scale.Rate), "--clock.epoch", f.opts.Scale.Epoch.Format(time.RFC3339Nano)}
}

// Address is the daemons' balancer URL.
func (f *Fleet) Address() string { return "http://" + f.LBAddr }

// Close kills every process, drops the database and stops a local server.
// keep leaves the work directory (logs) in place.
func (f *Fleet) Close(keep bool) {
	f.Sup.Stop()
	if f.DB != nil {
		f.DB.Drop()
	}
	if f.Server != nil && f.opts.Server == nil {
		f.Server.Stop()
	}
	if f.Dir != "" && !keep {
		os.RemoveAll(f.Dir)
	}
}

// ControlClient is a ControlService client with the fleet's token.
//
// It speaks HTTP/2 without TLS (h2c), as the CLI does to a plaintext api:
// every call shares one connection. (http.DefaultClient would speak
// HTTP/1.1 and keep two idle connections, so concurrent callers would
// open a connection for most calls.)
func (f *Fleet) ControlClient() controlv1connect.ControlServiceClient {
	protocols := new(http.Protocols)
	protocols.SetUnencryptedHTTP2(true)
	client := &http.Client{Transport: &http.Transport{Protocols: protocols}}
	return controlv1connect.NewControlServiceClient(client, "http://"+f.APIAddr,
		connect.WithInterceptors(bearer(f.Token)))
}

type bearer string

func (b bearer) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		req.Header().Set("Authorization", "Bearer "+string(b))
		return next(ctx, req)
	}
}
func (b bearer) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}
func (b bearer) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// Producer creates commands for random nodes through the api or by INSERT.
type Producer struct {
	viaAPI bool
	client controlv1connect.ControlServiceClient
	f      *Fleet
	// wake tells the gateways about direct inserts after their commit,
	// coalesced, as the api does (like River's inserting client).
	wake *cmdwake.Notifier
}

// NewProducer returns a producer; viaAPI false inserts rows directly.
func (f *Fleet) NewProducer(viaAPI bool) *Producer {
	p := &Producer{viaAPI: viaAPI && f.API != nil, f: f}
	if p.viaAPI {
		p.client = f.ControlClient()
	} else {
		p.wake = cmdwake.New(f.DB.Pool, cmdwake.DefaultInterval, nil)
	}
	return p
}

// Close sends the last pending wake-up.
func (p *Producer) Close() {
	if p.wake != nil {
		p.wake.Close()
	}
}

// ViaAPI reports whether commands go through ControlService.CreateCommand.
func (p *Producer) ViaAPI() bool { return p.viaAPI }

// Create creates one command for node (no deadline within the run).
func (p *Producer) Create(ctx context.Context, node string) error {
	if p.viaAPI {
		_, err := p.client.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{
			NodeId: node, Kind: "bench.echo", Payload: []byte("x")}))
		return err
	}
	_, err := p.f.DB.Pool.Exec(ctx, `INSERT INTO commands (node_id, kind, payload) VALUES ($1, 'bench.echo', 'x')`, node)
	if err == nil {
		p.wake.Created(node)
	}
	return err
}
