// Package api serves ControlService (proto/leasehold/control/v1): the
// operator and client API of the control plane, over Connect, gRPC and
// gRPC-Web with binary and JSON codecs, on HTTP/1.1 and HTTP/2 (h2c, or
// TLS). Every call needs a bearer token whose role permits it (auth.go);
// every request is validated in full before any SQL runs (validate.go).
// EnrollmentService (proto/leasehold/enroll/v1) is served on the same port
// without a bearer token: its calls carry a join token or a node
// credential (enroll.go).
// The service is stateless: any number of replicas may serve side by side.
package api

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"connectrpc.com/grpchealth"
	"connectrpc.com/grpcreflect"
	"github.com/grafana/dskit/services"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/leasehold/leasehold/pkg/cmdwake"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/enroll/v1/enrollv1connect"
	"github.com/leasehold/leasehold/pkg/health"
	"github.com/leasehold/leasehold/pkg/reload"
)

// Deps are what the api service needs from its process.
type Deps struct {
	DB       *pgxpool.Pool
	Logger   *slog.Logger
	Registry prometheus.Registerer
	// Health, when set, gets the "api" readiness check.
	Health *health.Handler
	// Tracer traces every call (nil: the global provider, a no-op unless
	// the process turned tracing on).
	Tracer trace.TracerProvider
	// NotifyURL is a direct database URL to LISTEN on for finished
	// commands (WaitCommand); "" polls only.
	NotifyURL string
	// ID is the process id: the read replica's connections report
	// application_name "leasehold-api-read:<ID>".
	ID string
	// MaxConns caps the read replica's pool (--db-max-conns; 0: pgx's
	// default). The primary's pool is DB, sized by its opener.
	MaxConns int32
}

// Service is the api's dskit service: it listens in starting, serves in
// running and shuts the server down gracefully when stopped.
type Service struct {
	services.Service

	cfg     Config
	log     *slog.Logger
	handler *Handler
	waiter  *waiter
	checker *grpchealth.StaticChecker
	role    *health.RoleGauge
	srv     *http.Server
	ln      net.Listener
	serving atomic.Bool
	reload  *reloaders
	// reads is the read replica of --api.read-database-url; nil without.
	reads *readReplica
}

// New builds the service; it listens only once started.
// callerPingAfter and callerPingTimeout are the api's HTTP/2 keep-alive
// towards its callers: a connection silent this long is PINGed, and closed
// when the PING goes unanswered for callerPingTimeout.
const (
	callerPingAfter   = 10 * time.Second
	callerPingTimeout = 5 * time.Second
)

func New(cfg Config, deps Deps) (*Service, error) {
	log := deps.Logger.With("component", "api")
	reloaders, err := newReloaders(cfg, Deps{DB: deps.DB, Logger: log, Registry: deps.Registry})
	if err != nil {
		return nil, err
	}
	keys := reloaders.keys
	s := &Service{
		reload:  reloaders,
		cfg:     cfg,
		log:     log,
		waiter:  newWaiter(deps.DB, deps.NotifyURL, cfg.WaitPollInterval, log),
		checker: grpchealth.NewStaticChecker(),
		role:    health.NewRoleGauge(deps.Registry, "api"),
	}
	s.checker.SetStatus("", grpchealth.StatusNotServing)
	s.checker.SetStatus(controlv1connect.ControlServiceName, grpchealth.StatusNotServing)
	relay, err := newRelayDialer(cfg, reload.Options{Logger: log, Registerer: deps.Registry})
	if err != nil {
		return nil, err
	}
	reloaders.watchers = append(reloaders.watchers, relay.watchers()...)
	if cfg.ReadDatabaseURL != "" {
		name := "leasehold-api-read"
		if deps.ID != "" {
			name += ":" + deps.ID
		}
		if s.reads, err = newReadReplica(cfg, name, deps.MaxConns, deps.Registry, log.With("db", "read-replica")); err != nil {
			return nil, err
		}
	}
	s.handler = &Handler{db: deps.DB, reads: s.reads, log: log, waiter: s.waiter, wake: cmdwake.New(deps.DB, cmdwake.DefaultInterval, log),
		defaultTimeout: cfg.DefaultCommandTimeout, maxPayload: cfg.MaxPayloadBytes, maxQueued: cfg.MaxQueuedPerNode, sinkEgress: cfg.SinkEgress, relay: relay}
	if cfg.OverloadAdmission {
		s.handler.overload = newOverloadWatch(deps.DB, deps.Registry, log)
	}
	if cfg.CreateGroup > 1 {
		s.handler.group = newCreateGroup(s.handler, cfg.CreateGroup, deps.Registry)
	}
	m := newMetrics(deps.Registry, s.waiter)

	otelInterceptor, err := newTraceInterceptor(deps.Tracer)
	if err != nil {
		return nil, err
	}
	auth := &authInterceptor{keys: keys, log: log}
	lim := newCallLimiter(cfg.RateLimit, cfg.RateBurst)
	mux := http.NewServeMux()
	handlerOpts := []connect.HandlerOption{
		connect.WithInterceptors(otelInterceptor, m.interceptor(), auth),
		connect.WithReadMaxBytes(cfg.MaxMessageBytes),
		connect.WithCompressMinBytes(1024),
		boundedGzip(int64(cfg.MaxMessageBytes)),
	}
	path, control := controlv1connect.NewControlServiceHandler(s.handler, handlerOpts...)
	// The token is checked before the body is read or decompressed.
	mux.Handle(path, authenticateFirst(auth, m, lim, int64(cfg.MaxMessageBytes), control))
	// The streams that relay bytes as they are, each on its own handler
	// that never gzips per message: OpenTunnel (a tunnel's bytes, mostly
	// already compressed or encrypted) and StreamCommandOutput (where gzip
	// would cost the api more CPU per byte than everything else on the live
	// path; docs/decisions.md, "Live output past the stored cap").
	raw := func(method protoreflect.Name) connect.HandlerOption {
		return connect.WithHandlerOptions(
			connect.WithSchema(controlv1.File_leasehold_control_v1_control_proto.Services().ByName("ControlService").Methods().ByName(method)),
			connect.WithHandlerOptions(handlerOpts...), connect.WithCompressMinBytes(math.MaxInt))
	}
	mux.Handle(controlv1connect.ControlServiceOpenTunnelProcedure, authenticateFirst(auth, m, lim, int64(cfg.MaxMessageBytes),
		connect.NewBidiStreamHandler(controlv1connect.ControlServiceOpenTunnelProcedure, s.handler.OpenTunnel, raw("OpenTunnel"))))
	mux.Handle(controlv1connect.ControlServiceStreamCommandOutputProcedure, authenticateFirst(auth, m, lim, int64(cfg.MaxMessageBytes),
		connect.NewServerStreamHandler(controlv1connect.ControlServiceStreamCommandOutputProcedure, s.handler.StreamCommandOutput, raw("StreamCommandOutput"))))
	// EnrollmentService beside it, without the bearer-token interceptor:
	// its calls authenticate with what they carry (enroll.go).
	enrollPath, enroll := enrollv1connect.NewEnrollmentServiceHandler(s.handler,
		connect.WithInterceptors(otelInterceptor, m.interceptor()),
		connect.WithReadMaxBytes(enrollMaxMessageBytes),
		boundedGzip(enrollMaxMessageBytes),
	)
	mux.Handle(enrollPath, authenticateFirst(auth, m, lim, int64(cfg.MaxMessageBytes), enroll))
	mux.Handle(grpchealth.NewHandler(s.checker))
	reflector := grpcreflect.NewStaticReflector(controlv1connect.ControlServiceName, enrollv1connect.EnrollmentServiceName,
		grpchealth.HealthV1ServiceName)
	mux.Handle(grpcreflect.NewHandlerV1(reflector))
	mux.Handle(grpcreflect.NewHandlerV1Alpha(reflector))

	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	s.srv = &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       30 * time.Second,
		// WaitCommand may hold a call for MaxWait.
		WriteTimeout:   MaxWait + 15*time.Second,
		IdleTimeout:    2 * time.Minute,
		MaxHeaderBytes: 64 << 10,
		ErrorLog:       slog.NewLogLogger(log.Handler(), slog.LevelDebug),
		Protocols:      protocols,
		// An idle connection is PINGed after 10 s and closed when the PING
		// goes unanswered for 5 s: a caller whose network went silent (no
		// FIN, no RST) stops holding its streams, a tunnel's node slot and
		// target connection among them, within about 15 s instead of until
		// the gateway's tunnel idle timeout.
		HTTP2: &http.HTTP2Config{MaxConcurrentStreams: 250, SendPingTimeout: callerPingAfter, PingTimeout: callerPingTimeout},
	}
	if reloaders.tls != nil {
		protocols.SetHTTP2(true)
		s.srv.TLSConfig = reloaders.tls.ServerConfig()
	} else {
		protocols.SetUnencryptedHTTP2(true) // h2c, so gRPC clients work without TLS
	}
	if deps.Health != nil {
		deps.Health.AddReadiness("api", func(context.Context) error {
			if !s.serving.Load() {
				return errors.New("ControlService is not serving")
			}
			return nil
		})
		deps.Health.AddDetail("api", func(context.Context) any {
			return map[string]any{"serving": s.serving.Load(), "addr": s.Addr(), "tls": cfg.TLSCert != "",
				"tokens": keys.Len(), "wait_commands": s.waiter.len()}
		})
		if s.reads != nil {
			// Never a readiness check: the lists fall back to the primary.
			deps.Health.AddDetail("api_read_replica", func(context.Context) any { return s.reads.detail() })
		}
	}
	s.Service = services.NewBasicService(s.starting, s.running, s.stopping).WithName("api")
	return s, nil
}

// Addr is the address ControlService listens on, once started.
func (s *Service) Addr() string {
	if s.ln == nil {
		return ""
	}
	return s.ln.Addr().String()
}

func (s *Service) starting(ctx context.Context) error {
	ln, err := net.Listen("tcp", s.cfg.ListenAddr)
	if err != nil {
		return fmt.Errorf("listen on --listen-addr %s: %w", s.cfg.ListenAddr, err)
	}
	if s.reads != nil {
		if err := s.reads.open(ctx); err != nil {
			_ = ln.Close()
			return err
		}
	}
	s.ln = ln
	return nil
}

// stopping closes the read replica's pool once no call is served.
func (s *Service) stopping(error) error {
	if s.reads != nil {
		s.reads.close()
	}
	return nil
}

func (s *Service) running(ctx context.Context) error {
	// Serve mutates the server's TLS and HTTP/2 settings: read them first.
	useTLS := s.srv.TLSConfig != nil
	serveErr := make(chan error, 1)
	go func() {
		if useTLS {
			serveErr <- s.srv.ServeTLS(s.ln, "", "")
		} else {
			serveErr <- s.srv.Serve(s.ln)
		}
	}()
	waitCtx, stopWaiter := context.WithCancel(context.WithoutCancel(ctx))
	waiterDone := make(chan struct{})
	go func() { defer close(waiterDone); s.waiter.run(waitCtx) }()
	reloadDone := make(chan struct{})
	go func() { defer close(reloadDone); s.reload.run(waitCtx, s.cfg) }()
	probeDone := make(chan struct{})
	go func() {
		defer close(probeDone)
		if s.reads != nil {
			s.reads.run(waitCtx)
		}
	}()
	// Creates are written until every call has been served: the groups
	// stop after the server's shutdown below.
	groupCtx, stopGroups := context.WithCancel(context.WithoutCancel(ctx))
	defer stopGroups()
	groupDone := make(chan struct{})
	go func() {
		defer close(groupDone)
		if s.handler.group != nil {
			s.handler.group.run(groupCtx)
		}
	}()
	overloadDone := make(chan struct{})
	go func() {
		defer close(overloadDone)
		if s.handler.overload != nil {
			s.handler.overload.run(waitCtx)
		}
	}()

	s.checker.SetStatus("", grpchealth.StatusServing)
	s.checker.SetStatus(controlv1connect.ControlServiceName, grpchealth.StatusServing)
	s.serving.Store(true)
	s.role.Set(health.RoleActive)
	s.log.Info("ControlService serving", "addr", s.Addr(), "tls", useTLS)

	var failure error
	select {
	case <-ctx.Done():
	case err := <-serveErr:
		failure = fmt.Errorf("serve ControlService: %w", err)
	}
	s.serving.Store(false)
	s.role.Set(health.RoleStandby)
	s.checker.SetStatus("", grpchealth.StatusNotServing)
	s.checker.SetStatus(controlv1connect.ControlServiceName, grpchealth.StatusNotServing)
	// Waiting calls answer at once with the command as it stands, then the
	// server lets in-flight calls finish within the grace period.
	stopWaiter()
	<-waiterDone
	<-reloadDone
	<-probeDone
	<-overloadDone
	shutdownCtx, cancel := context.WithTimeout(context.Background(), s.cfg.ShutdownGrace)
	defer cancel()
	if err := s.srv.Shutdown(shutdownCtx); err != nil {
		s.log.Warn("ControlService did not drain in time; closing connections", "grace", s.cfg.ShutdownGrace, "err", err)
		_ = s.srv.Close()
	}
	stopGroups()
	<-groupDone
	if failure == nil {
		if err := <-serveErr; err != nil && !errors.Is(err, http.ErrServerClosed) {
			failure = fmt.Errorf("serve ControlService: %w", err)
		}
	}
	s.log.Info("ControlService stopped")
	return failure
}
