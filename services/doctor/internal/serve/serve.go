// Package serve is `leasehold-doctor serve`: the pkg/process daemon that
// serves DoctorService over Connect (with grpchealth and grpcreflect) and
// exports one gauge per finding on /metrics, refreshed on an interval.
package serve

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"connectrpc.com/connect"
	"connectrpc.com/grpchealth"
	"connectrpc.com/grpcreflect"
	"github.com/grafana/dskit/services"
	"github.com/prometheus/client_golang/prometheus"

	doctorv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/doctor/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/doctor/v1/doctorv1connect"
	"github.com/leasehold/leasehold/pkg/health"
	"github.com/leasehold/leasehold/pkg/lifecycle"
	"github.com/leasehold/leasehold/pkg/process"
	"github.com/leasehold/leasehold/pkg/reload"
	"github.com/leasehold/leasehold/services/doctor/internal/doctor"
)

// Config is serve's own configuration beside the checks' thresholds.
type Config struct {
	// Doctor holds the checks' thresholds and expectations.
	Doctor doctor.Config
	// ListenAddr serves DoctorService (h2c and HTTP/1.1); empty mounts it
	// on the --http-addr server instead.
	ListenAddr string
	// Interval is how often the gauges are refreshed.
	Interval time.Duration
	// Token, when set, is the bearer token DoctorService requires.
	Token string
	// TLS serves ListenAddr over TLS when its Cert and Key are set; the
	// files are re-read every minute.
	TLS reload.TLSFiles
}

// RegisterFlags registers serve's flags on f, each name under prefix.
func (c *Config) RegisterFlags(prefix string, f *flag.FlagSet) {
	c.Doctor.RegisterFlags(prefix, f)
	f.StringVar(&c.ListenAddr, prefix+"listen-addr", "127.0.0.1:9446", "address of DoctorService (Connect, gRPC, gRPC-Web; h2c); empty serves it on --http-addr")
	f.DurationVar(&c.Interval, prefix+"interval", 30*time.Second, "how often the checks run to refresh leasehold_doctor_finding")
	f.StringVar(&c.Token, prefix+"api-token", "", "bearer token required by DoctorService (empty: none)")
	f.StringVar(&c.TLS.Cert, prefix+"tls-cert", "", "TLS certificate (PEM) of --listen-addr, with --tls-key; re-read on change")
	f.StringVar(&c.TLS.Key, prefix+"tls-key", "", "key (PEM) of --tls-cert")
}

// Listeners lists DoctorService's own listener for
// lifecycle.CheckPlaintext.
func (c *Config) Listeners() []lifecycle.Listener {
	return []lifecycle.Listener{{Flag: "listen-addr", Addr: c.ListenAddr, TLS: c.TLS.Cert != "", TLSFlag: "tls-cert"}}
}

// Validate checks the configuration.
func (c *Config) Validate() error {
	var errs []error
	if c.Interval < time.Second {
		errs = append(errs, fmt.Errorf("--interval %s must be at least 1s", c.Interval))
	}
	if (c.TLS.Cert == "") != (c.TLS.Key == "") {
		errs = append(errs, errors.New("--tls-cert and --tls-key go together"))
	}
	if c.TLS.Cert != "" && c.ListenAddr == "" {
		errs = append(errs, errors.New("--tls-cert needs --listen-addr (DoctorService on --http-addr is plaintext)"))
	}
	return errors.Join(c.Doctor.Validate(), errors.Join(errs...))
}

// Run runs the daemon with args and returns its exit status.
func Run(ctx context.Context, args []string, stderr *os.File) int {
	var cfg Config
	return process.Run(ctx, process.Spec{
		Name:      "doctor",
		HTTPAddr:  "127.0.0.1:9106",
		Flags:     func(fs *flag.FlagSet) { cfg.RegisterFlags("", fs) },
		Validate:  cfg.Validate,
		Listeners: cfg.Listeners,
		Build: func(ctx context.Context, p *process.Process) ([]services.Service, error) {
			return Build(cfg, p)
		},
	}, args, stderr)
}

// Build constructs serve's components on a started process.
func Build(cfg Config, p *process.Process) ([]services.Service, error) {
	d, err := doctor.New(cfg.Doctor, p.DB)
	if err != nil {
		return nil, err
	}
	r := newRefresher(d, cfg.Interval, p.Registry, p.Logger)
	p.Health.AddDetail("findings", r.detail)

	mux := http.NewServeMux()
	path, h := doctorv1connect.NewDoctorServiceHandler(&handler{d: d})
	if cfg.Token != "" {
		h = requireToken(cfg.Token, h)
	}
	mux.Handle(path, h)
	checker := grpchealth.NewStaticChecker(doctorv1connect.DoctorServiceName)
	mux.Handle(grpchealth.NewHandler(checker))
	reflector := grpcreflect.NewStaticReflector(doctorv1connect.DoctorServiceName)
	mux.Handle(grpcreflect.NewHandlerV1(reflector))
	mux.Handle(grpcreflect.NewHandlerV1Alpha(reflector))

	comps := []services.Service{r}
	if cfg.ListenAddr == "" {
		p.Mux.Handle("/", mux)
		return comps, nil
	}
	api, err := newAPIServer(cfg.ListenAddr, mux, p.Logger)
	if err != nil {
		return nil, err
	}
	if cfg.TLS.Cert != "" {
		base := &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"h2", "http/1.1"}}
		t, err := reload.NewTLS("doctor", cfg.TLS, base, reload.Options{Logger: p.Logger, Registerer: p.Registry, Clock: p.Clock})
		if err != nil {
			_ = api.ln.Close()
			return nil, fmt.Errorf("load --tls-cert %s / --tls-key %s: %w", cfg.TLS.Cert, cfg.TLS.Key, err)
		}
		api.ln = tls.NewListener(api.ln, t.ServerConfig())
		api.srv.Protocols.SetHTTP2(true)
		api.reload = t
	}
	p.Logger.Info("DoctorService listening", "listen_addr", api.ln.Addr().String(), "tls", cfg.TLS.Cert != "")
	return append(comps, api), nil
}

// handler implements DoctorService: every call runs the checks afresh.
type handler struct{ d *doctor.Doctor }

func (h *handler) Check(ctx context.Context, req *connect.Request[doctorv1.CheckRequest]) (*connect.Response[doctorv1.CheckResponse], error) {
	rep, err := h.d.Run(ctx, req.Msg.GetCodes())
	if err != nil {
		var unknown *doctor.UnknownCodeError
		if errors.As(err, &unknown) {
			return nil, connect.NewError(connect.CodeInvalidArgument, err)
		}
		return nil, connect.NewError(connect.CodeUnavailable, err)
	}
	return connect.NewResponse(rep.Proto()), nil
}

func requireToken(token string, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !health.Authorized(r, token) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			_, _ = w.Write([]byte(`{"code":"unauthenticated","message":"bearer token required"}`))
			return
		}
		next.ServeHTTP(w, r)
	})
}

// refresher runs every check on an interval and sets
// leasehold_doctor_finding{code}: 0 ok, 1 warn, 2 critical, -1 unchecked.
type refresher struct {
	services.Service
	d        *doctor.Doctor
	logger   *slog.Logger
	finding  *prometheus.GaugeVec
	lastRun  prometheus.Gauge
	failures prometheus.Counter

	mu   sync.Mutex
	last doctor.Report
	err  error
}

func newRefresher(d *doctor.Doctor, every time.Duration, reg prometheus.Registerer, logger *slog.Logger) *refresher {
	r := &refresher{
		d:      d,
		logger: logger,
		finding: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "leasehold_doctor_finding",
			Help: "Severity of each doctor finding: 0 ok, 1 warn, 2 critical, -1 not checked.",
		}, []string{"code"}),
		lastRun: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "leasehold_doctor_last_run_timestamp_seconds",
			Help: "Database time of the last completed run of the checks.",
		}),
		failures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_doctor_run_failures_total",
			Help: "Runs of the checks that could not reach the database.",
		}),
	}
	reg.MustRegister(r.finding, r.lastRun, r.failures)
	for _, c := range doctor.Codes() {
		r.finding.WithLabelValues(c).Set(-1)
	}
	r.Service = services.NewTimerService(every, func(ctx context.Context) error {
		r.refresh(ctx)
		return nil
	}, func(ctx context.Context) error {
		r.refresh(ctx)
		return nil
	}, nil).WithName("doctor-refresher")
	return r
}

// refresh runs the checks; a run that cannot reach the database marks every
// finding unchecked rather than keeping stale values.
func (r *refresher) refresh(ctx context.Context) {
	rep, err := r.d.Run(ctx, nil)
	r.mu.Lock()
	r.last, r.err = rep, err
	r.mu.Unlock()
	if err != nil {
		if ctx.Err() == nil {
			r.failures.Inc()
			r.logger.Warn("doctor run failed", "err", err)
		}
		for _, c := range doctor.Codes() {
			r.finding.WithLabelValues(c).Set(-1)
		}
		return
	}
	for _, f := range rep.Findings {
		r.finding.WithLabelValues(f.Code).Set(f.Severity.Gauge())
	}
	r.lastRun.Set(float64(rep.CheckedAt.UnixNano()) / 1e9)
	if w := rep.Worst(); w != doctor.SeverityOK {
		r.logger.Info("doctor findings", "status", w.String())
	}
}

func (r *refresher) detail(context.Context) any {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.err != nil {
		return map[string]any{"error": r.err.Error()}
	}
	out := map[string]any{"checked_at": r.last.CheckedAt, "status": r.last.Worst().String()}
	sev := map[string]string{}
	for _, f := range r.last.Findings {
		sev[f.Code] = f.Severity.String()
	}
	out["findings"] = sev
	return out
}

// apiServer serves DoctorService on its own listener with h2c.
type apiServer struct {
	services.Service
	ln     net.Listener
	srv    *http.Server
	reload *reload.TLS // nil: h2c
}

func newAPIServer(addr string, h http.Handler, logger *slog.Logger) (*apiServer, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on --listen-addr %s: %w", addr, err)
	}
	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	s := &apiServer{ln: ln, srv: &http.Server{
		Handler:           h,
		Protocols:         protocols,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      2 * time.Minute, // a Check runs every check
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
	}}
	s.Service = services.NewBasicService(nil, s.running, nil).WithName("doctor-api")
	return s, nil
}

func (s *apiServer) running(ctx context.Context) error {
	if s.reload != nil {
		var wg sync.WaitGroup
		defer wg.Wait()
		wg.Go(func() { s.reload.Run(ctx, time.Minute) })
	}
	return lifecycle.Serve(ctx, s.srv, s.ln, "DoctorService server", 5*time.Second)
}
