// Package agent is the site agent (docs/design.md#site-agents): a node session
// through pkg/daemon (kind site_agent), the boot grant and its self-fence,
// the proxy DHCP responder, TFTP, boot files over HTTP and iPXE scripts
// (only while the grant is live),
// discovery reports vouched for by the boot epoch, and, on both agents at
// all times, the image cache and Redfish BMC commands, journalled on disk
// (--journal) so none runs twice across the agent's own restart.
//
// Roles, exported as leasehold_role{component="site-boot"}:
//
//	standby ──grant (active, epoch >= seen)──▶ active ──no fresh grant for self-fence, or session closed──▶ fenced
//	   ▲                                          │                                                      │
//	   └──────────── spec: not active ────────────┴───────────── fresh grant ◀───────────────────────────┘
package agent

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/jonboulle/clockwork"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/leasehold/leasehold/pkg/daemon"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/health"
	"github.com/leasehold/leasehold/pkg/reload"
	"github.com/leasehold/leasehold/services/site-agent/internal/imagecache"
	"github.com/leasehold/leasehold/services/site-agent/internal/pxe"
	"github.com/leasehold/leasehold/services/site-agent/internal/redfish"
	"github.com/leasehold/leasehold/services/site-agent/internal/tftp"
)

// DiscoveryEventKind is the event kind of a discovery report.
const DiscoveryEventKind = "discovery"

// maxReported bounds the discovery dedup table.
const maxReported = 4096

// Deps are what an agent takes from its process.
type Deps struct {
	Logger   *slog.Logger
	Registry prometheus.Registerer
	Health   *health.Handler
	Clock    clockwork.Clock
	// Version is reported on Hello.
	Version string
}

// Agent is the site agent component: a dskit service.
type Agent struct {
	services.Service

	cfg     Config
	log     *slog.Logger
	clock   clockwork.Clock
	d       *daemon.Daemon
	tls     *reload.ClientTLS // nil for an http:// gateway
	journal *daemon.FileJournal
	fence   *Fence
	dhcp    *pxe.Responder
	tftp    *tftp.Server
	files   *os.Root
	hosts   *pxe.Hosts
	cache   *imagecache.Cache
	bmc     *redfish.Client
	role    *health.RoleGauge
	events  *prometheus.CounterVec

	bootLn  net.Listener
	bootSrv *http.Server

	mu       sync.Mutex
	reported map[string]uint64 // MAC -> boot epoch it was reported at
}

// New builds an agent from a resolved configuration.
func New(cfg Config, deps Deps) (*Agent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if deps.Logger == nil {
		deps.Logger = slog.New(slog.DiscardHandler)
	}
	if deps.Registry == nil {
		deps.Registry = prometheus.NewRegistry()
	}
	if deps.Clock == nil {
		deps.Clock = clockwork.NewRealClock()
	}
	a := &Agent{cfg: cfg, log: deps.Logger, clock: deps.Clock, hosts: pxe.NewHosts(), reported: map[string]uint64{}}
	if cfg.HostsFile != "" {
		if err := a.hosts.LoadFile(cfg.HostsFile); err != nil {
			return nil, err
		}
	}
	var err error
	if a.cache, err = imagecache.New(cfg.Cache, nil, deps.Logger.With("component", "image-cache"), deps.Registry); err != nil {
		return nil, err
	}
	if a.bmc, err = redfish.New(cfg.BMC, deps.Logger.With("component", "bmc")); err != nil {
		return nil, err
	}
	var clientTLS *tls.Config
	if strings.HasPrefix(cfg.GatewayURL, "https://") {
		a.tls, err = reload.NewNodeClientTLS("site-agent", cfg.TLS, cfg.NodeID, reload.Options{Logger: deps.Logger, Registerer: deps.Registry, Clock: deps.Clock})
		if err != nil {
			return nil, fmt.Errorf("--tls.cert-file and --node-id: %w", err)
		}
		clientTLS = a.tls.Config()
	}
	// The journal is opened last, so nothing after it but the daemon's
	// construction can fail; it is closed when the service stops (or fails
	// to start).
	if a.journal, err = openJournal(cfg.Journal); err != nil {
		return nil, err
	}
	a.d, err = daemon.New(daemon.Config{
		Address: cfg.GatewayURL, NodeID: cfg.NodeID, Credential: cfg.Credential,
		Kind: nodev1.NodeKind_NODE_KIND_SITE_AGENT, SiteID: cfg.SiteID, Version: deps.Version,
		Journal: a.journal, TLS: clientTLS,
		Handler: a.handleCommand, OnSpec: func(s *nodev1.NodeSpec) { a.fence.Apply(s) },
		BackoffBase: min(time.Second, cfg.BackoffMax), BackoffMax: cfg.BackoffMax,
		Clock: deps.Clock, Logger: deps.Logger.With("component", "daemon"),
	})
	if err != nil {
		_ = a.journal.Close()
		return nil, err
	}
	a.fence = NewFence(cfg.SelfFence, cfg.SiteID, deps.Clock, deps.Logger.With("component", "boot-fence"),
		func() bool { return a.d.Welcome() != nil })
	a.dhcp = pxe.New(cfg.DHCP, a.fence.Answering, a.onBoot, deps.Logger.With("component", "dhcp"), deps.Registry)
	a.tftp = tftp.New(cfg.TFTP, a.fence.Answering, deps.Logger.With("component", "tftp"), deps.Registry)
	a.role = health.NewRoleGauge(deps.Registry, "site-boot")
	a.events = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "leasehold_site_discovery_reports_total",
		Help: "Discovery reports by outcome (sent, not_connected)."}, []string{"outcome"})
	deps.Registry.MustRegister(a.events)
	if deps.Health != nil {
		deps.Health.AddReadiness("session", func(context.Context) error {
			if a.d.Welcome() == nil {
				return errors.New("no session with a gateway")
			}
			return nil
		})
		deps.Health.AddDetail("site-agent", func(context.Context) any { return a.detail() })
	}
	a.Service = services.NewBasicService(a.starting, a.running, nil).WithName("site-agent")
	return a, nil
}

// Answering reports whether this agent answers DHCP/iPXE now, and its epoch.
func (a *Agent) Answering() (uint64, bool) { return a.fence.Answering() }

// DHCPAddr is the bound DHCP address once started.
func (a *Agent) DHCPAddr() *net.UDPAddr { return a.dhcp.Addr() }

// BootAddr is the bound address of scripts and images once started.
func (a *Agent) BootAddr() string {
	if a.bootLn == nil {
		return ""
	}
	return a.bootLn.Addr().String()
}

// Cache is the image cache.
func (a *Agent) Cache() *imagecache.Cache { return a.cache }

func (a *Agent) detail() any {
	d := a.fence.Detail()
	d["role"] = a.fence.Role().String()
	d["connected"] = a.d.Welcome() != nil
	d["site_id"] = a.cfg.SiteID
	return d
}

func (a *Agent) starting(context.Context) (err error) {
	defer func() {
		if err != nil { // running, which closes the journal, never runs
			if cerr := a.journal.Close(); cerr != nil {
				a.log.Warn("close the journal", "journal", a.cfg.Journal, "err", cerr)
			}
		}
	}()
	files, err := os.OpenRoot(a.cfg.TFTP.Root)
	if err != nil {
		return fmt.Errorf("open --tftp.root: %w", err)
	}
	a.files = files
	for _, f := range []string{a.cfg.DHCP.BootFileBIOS, a.cfg.DHCP.BootFileEFI} {
		if st, err := files.Stat(f); err != nil || !st.Mode().IsRegular() {
			a.log.Warn("boot file missing from --tftp.root: firmware asking for it will fail (install Debian's ipxe package and copy it, see docs/site-agent.md)",
				"file", f, "tftp_root", a.cfg.TFTP.Root)
		}
	}
	if err := a.dhcp.Listen(); err != nil {
		return err
	}
	if err := a.tftp.Listen(); err != nil {
		_ = a.dhcp.Close()
		return err
	}
	ln, err := net.Listen("tcp", a.cfg.BootListenAddr)
	if err != nil {
		_ = a.dhcp.Close()
		_ = a.tftp.Close()
		return fmt.Errorf("listen on --boot.listen-addr %s: %w", a.cfg.BootListenAddr, err)
	}
	a.bootLn = ln
	mux := http.NewServeMux()
	mux.HandleFunc("GET /boot/{file}", a.serveScript)
	mux.HandleFunc("GET /tftp/{file...}", a.serveBootFile)
	mux.HandleFunc("HEAD /tftp/{file...}", a.serveBootFile)
	mux.Handle("GET /images/sha256/{digest}", a.cache)
	mux.Handle("HEAD /images/sha256/{digest}", a.cache)
	a.bootSrv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute,
		MaxHeaderBytes: 16 << 10, ErrorLog: slog.NewLogLogger(a.log.Handler(), slog.LevelDebug)}
	a.log.Info("site agent listening", "dhcp", a.dhcp.Addr().String(), "pxe", fmt.Sprint(a.dhcp.PXEAddr()), "tftp", a.tftp.Addr().String(), "boot", ln.Addr().String(), "site", a.cfg.SiteID,
		"journal", a.cfg.Journal, "journal_in_flight", len(a.journal.InFlight()))
	return nil
}

func (a *Agent) running(ctx context.Context) error {
	errc := make(chan error, 3)
	go func() { errc <- fmt.Errorf("dhcp: %w", a.dhcp.Serve()) }()
	go func() { errc <- fmt.Errorf("tftp: %w", a.tftp.Serve()) }()
	go func() { errc <- fmt.Errorf("boot http: %w", a.bootSrv.Serve(a.bootLn)) }()
	dctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _ = a.d.Run(dctx) }()
	go func() { defer wg.Done(); a.watchRole(dctx) }()
	if a.tls != nil && a.tls.Watcher != nil {
		wg.Go(func() { a.tls.Run(dctx, reload.DefaultInterval) })
	}

	var failure error
	select {
	case <-ctx.Done():
	case failure = <-errc:
	}
	_ = a.dhcp.Close()
	_ = a.tftp.Close()
	sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
	_ = a.bootSrv.Shutdown(sctx)
	a.bmc.Close(sctx)
	scancel()
	cancel()
	wg.Wait() // the daemon has returned, and with it every command
	_ = a.files.Close()
	if err := a.journal.Close(); err != nil {
		failure = errors.Join(failure, err)
	}
	return failure
}

// TFTPAddr is the bound TFTP address once started.
func (a *Agent) TFTPAddr() *net.UDPAddr { return a.tftp.Addr() }

// serveBootFile serves a file of the TFTP root over HTTP (UEFI HTTP boot)
// while active; a standby answers 503. Names that leave the root are
// refused like over TFTP.
func (a *Agent) serveBootFile(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("file")
	if _, ok := a.fence.Answering(); !ok {
		http.Error(w, "standby: this agent does not answer boot requests now", http.StatusServiceUnavailable)
		return
	}
	if !filepath.IsLocal(name) || strings.Contains(name, "\\") {
		a.log.Warn("boot file request refused: path outside the TFTP root", "client", r.RemoteAddr, "file", name)
		http.Error(w, "path outside the TFTP root", http.StatusBadRequest)
		return
	}
	f, err := a.files.Open(name)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			http.NotFound(w, r)
			return
		}
		a.log.Warn("boot file request refused", "client", r.RemoteAddr, "file", name, "err", err)
		http.Error(w, "path outside the TFTP root", http.StatusBadRequest)
		return
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil || !st.Mode().IsRegular() {
		http.NotFound(w, r)
		return
	}
	a.log.Info("boot file served over HTTP", "client", r.RemoteAddr, "file", name, "bytes", st.Size())
	w.Header().Set("Content-Type", "application/efi")
	w.Header().Set("Cache-Control", "no-store")
	http.ServeContent(w, r, "", st.ModTime(), f)
}

// watchRole exports and logs the role as it changes.
func (a *Agent) watchRole(ctx context.Context) {
	t := a.clock.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	last := health.Role(-1)
	for {
		r := a.fence.Role()
		if r != last {
			a.role.Set(r)
			if last != -1 {
				a.log.Info("boot role changed", "from", last.String(), "to", r.String())
			}
			last = r
		}
		select {
		case <-ctx.Done():
			return
		case <-t.Chan():
		}
	}
}

// serveScript serves /boot/<mac>.ipxe while active; a standby answers 503.
func (a *Agent) serveScript(w http.ResponseWriter, r *http.Request) {
	file := r.PathValue("file")
	name, ok := strings.CutSuffix(file, ".ipxe")
	if !ok {
		http.NotFound(w, r)
		return
	}
	mac, err := pxe.ParseMAC(name)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	if _, ok := a.fence.Answering(); !ok {
		http.Error(w, "standby: this agent does not answer boot requests now", http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	p, _, ok := a.hosts.Lookup(mac)
	if !ok {
		a.log.Info("iPXE script served: no profile, wait and retry", "mac", mac.String(), "client", r.RemoteAddr)
		_, _ = w.Write([]byte(pxe.WaitScript))
		return
	}
	a.log.Info("iPXE script served", "mac", mac.String(), "client", r.RemoteAddr, "kernel", p.Kernel, "initrd", p.Initrd)
	_, _ = w.Write([]byte(pxe.Script(a.cfg.BootBaseURL, p)))
}

// onBoot reports an unknown MAC that PXE-booted, once per boot epoch.
func (a *Agent) onBoot(req pxe.Request) {
	if a.hosts.Known(req.MAC) {
		return
	}
	mac := req.MAC.String()
	a.mu.Lock()
	if a.reported[mac] == req.BootEpoch {
		a.mu.Unlock()
		return
	}
	if len(a.reported) >= maxReported {
		clear(a.reported)
	}
	a.reported[mac] = req.BootEpoch
	a.mu.Unlock()
	if err := a.report(req); err != nil {
		a.mu.Lock()
		delete(a.reported, mac) // the next boot attempt reports again
		a.mu.Unlock()
		a.events.WithLabelValues("not_connected").Inc()
		return
	}
	a.events.WithLabelValues("sent").Inc()
}

// report sends a discovery event for req at its boot epoch.
func (a *Agent) report(req pxe.Request) error {
	fields := map[string]any{"mac": req.MAC.String(), "site_id": a.cfg.SiteID, "arch": req.Arch,
		"vendor_class": req.VendorClass, "ipxe": req.IPXE}
	if len(req.UUID) > 0 {
		fields["uuid"] = fmt.Sprintf("%x", req.UUID)
	}
	if req.RelayAgentIP != nil {
		fields["relay"] = req.RelayAgentIP.String()
	}
	payload, err := structpb.NewStruct(fields)
	if err != nil {
		return err
	}
	return a.SendDiscovery(&nodev1.Event{
		EventId: fmt.Sprintf("discovery/%s/%d", strings.ReplaceAll(req.MAC.String(), ":", ""), req.BootEpoch),
		Kind:    DiscoveryEventKind, Payload: payload, OccurredAt: timestamppb.New(a.clock.Now()), BootEpoch: req.BootEpoch,
	})
}

// SendDiscovery sends a discovery event as is (tests use it to send a
// stale one).
func (a *Agent) SendDiscovery(ev *nodev1.Event) error { return a.d.SendEvent(ev) }

// handleCommand runs BMC commands on either agent.
func (a *Agent) handleCommand(ctx context.Context, cmd *nodev1.Command) daemon.Outcome {
	if !redfish.Handles(cmd.GetKind()) {
		return daemon.Outcome{ExitCode: 2, Err: fmt.Sprintf("site agent: unknown command kind %q", cmd.GetKind())}
	}
	out, err := a.bmc.Run(ctx, cmd.GetKind(), cmd.GetPayload())
	if err != nil {
		return daemon.Outcome{ExitCode: 1, Err: err.Error()}
	}
	return daemon.Outcome{Output: out}
}
