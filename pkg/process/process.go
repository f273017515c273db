package process

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jonboulle/clockwork"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold/migrations"
	"github.com/leasehold/leasehold/pkg/clock"
	"github.com/leasehold/leasehold/pkg/lifecycle"
	"github.com/leasehold/leasehold/pkg/pgdb"
)

// Process is what a service's build function receives: lifecycle's
// (Name, Logger, Registry, Health, Mux, Clock) with the service's
// configuration, its pool and its tracer.
type Process struct {
	*lifecycle.Process
	// Config is the parsed configuration; Config.ID is always set.
	Config Config
	// DB is the pgx pool, its readiness checked by /readyz.
	DB *pgxpool.Pool
	// Tracer is the OpenTelemetry tracer provider, also installed as the
	// global one: a no-op unless the OTEL_* environment turns tracing on.
	Tracer trace.TracerProvider

	closers []func()
}

// Spec describes a service for Main.
type Spec struct {
	// Name is the service's name.
	Name string
	// HTTPAddr is the default health address.
	HTTPAddr string
	// IDPrefix prefixes generated process ids (e.g. "gw_").
	IDPrefix string
	// GenericPlans plans the pool's cached statements once per connection
	// (pgdb.Config.GenericPlans): for services whose hot statements take
	// arrays as parameters. The process then also keeps the planner
	// statistics of fast-growing tables fresh (pgdb.RefreshPlanStats), so a
	// plan made on a near-empty table does not outlive it.
	GenericPlans bool
	// ShutdownTimeout is the default of --shutdown-timeout (90 s when zero).
	ShutdownTimeout time.Duration
	// Flags registers the service's own flags.
	Flags func(fs *flag.FlagSet)
	// Validate checks the service's own flags.
	Validate func() error
	// Listeners lists the service's listeners that carry credentials or
	// commands (lifecycle.Spec.Listeners).
	Listeners func() []lifecycle.Listener
	// Build constructs the service's components once the pool is open.
	Build func(ctx context.Context, p *Process) ([]services.Service, error)
}

// Main runs spec with os.Args and exits: 0 after a clean stop, 1 when a
// component failed, 2 on bad configuration.
func Main(spec Spec) {
	os.Exit(Run(context.Background(), spec, os.Args[1:], os.Stderr))
}

// Run is Main without the exit, for tests.
func Run(ctx context.Context, spec Spec, args []string, stderr *os.File) int {
	var cfg Config
	var p *Process
	return lifecycle.Run(ctx, lifecycle.Spec{
		Name: spec.Name, HTTPAddr: spec.HTTPAddr, IDPrefix: spec.IDPrefix, ShutdownTimeout: spec.ShutdownTimeout,
		Flags: func(fs *flag.FlagSet) {
			cfg.registerDatabaseFlags("", fs)
			if spec.Flags != nil {
				spec.Flags(fs)
			}
		},
		Validate: func() error {
			err := cfg.validateDatabase()
			if spec.Validate != nil {
				err = errors.Join(err, spec.Validate())
			}
			return err
		},
		Listeners: spec.Listeners,
		Identity:  func() (string, []any) { return cfg.ID, nil },
		Setup: func(ctx context.Context, lp *lifecycle.Process) (func(), error) {
			cfg.Config = lp.Config
			var err error
			p, err = open(ctx, spec, cfg, lp)
			if err != nil {
				return nil, err
			}
			return p.close, nil
		},
		Build: func(ctx context.Context, _ *lifecycle.Process) ([]services.Service, error) {
			svcs, err := spec.Build(ctx, p)
			if err == nil && spec.GenericPlans {
				svcs = append(svcs, newPlanStats(p))
			}
			return svcs, err
		},
	}, args, stderr)
}

// open starts tracing, connects the pool, checks (or migrates) the schema
// and installs the process clock; close undoes it after the components
// stopped.
func open(ctx context.Context, spec Spec, cfg Config, lp *lifecycle.Process) (*Process, error) {
	tp, queryTracer, stopTracing, err := setupTracing(ctx, spec.Name, cfg.ID, lp.Logger)
	if err != nil {
		return nil, err
	}
	p := &Process{Process: lp, Config: cfg, Tracer: tp, closers: []func(){stopTracing}}
	// Connect first: it refuses a standby before migrations would fail on it.
	db, err := pgdb.Connect(ctx, pgdb.Config{
		URL: cfg.DatabaseURL, AppName: "leasehold-" + spec.Name + ":" + cfg.ID,
		MaxConns: int32(cfg.MaxConns), Pooler: cfg.Pooler, Setting: "--database-url", Tracer: queryTracer,
		GenericPlans: spec.GenericPlans,
	})
	if err != nil {
		p.close()
		return nil, fmt.Errorf("connect to database: %w", err)
	}
	p.DB = db
	p.closers = append(p.closers, db.Close)
	if err := checkSchema(ctx, cfg, lp.Logger); err != nil {
		p.close()
		return nil, err
	}
	if lp.Clock, err = processClock(ctx, cfg, db, lp.Logger); err != nil {
		p.close()
		return nil, err
	}
	lp.Health.AddReadiness("database", func(ctx context.Context) error { return db.Ping(ctx) })
	return p, nil
}

// close runs the closers in reverse: the pool, then the trace flush.
func (p *Process) close() {
	for i := len(p.closers) - 1; i >= 0; i-- {
		p.closers[i]()
	}
}

// processClock builds the clock of --clock.rate. A scaled clock must agree
// with the database's compute_now() (scaled by clock.InstallSQL): a process
// started against an unscaled database refuses to run instead of treating
// every lease as minutes off.
func processClock(ctx context.Context, cfg Config, db *pgxpool.Pool, logger *slog.Logger) (clockwork.Clock, error) {
	s, err := cfg.Scale()
	if err != nil {
		return nil, err
	}
	clk, err := clock.New(s)
	if err != nil || s.Rate == 1 {
		return clk, err
	}
	var dbNow time.Time
	if err := db.QueryRow(ctx, "SELECT compute_now()").Scan(&dbNow); err != nil {
		return nil, fmt.Errorf("read compute_now(): %w", err)
	}
	if off := clk.Now().Sub(dbNow); off.Abs() > time.Second {
		return nil, fmt.Errorf("--clock.rate %g: the database's compute_now() is %s off the scaled clock; install the same scale with clock.InstallSQL", s.Rate, off.Round(time.Millisecond))
	}
	logger.Warn("scaled clock: timers run faster than wall time (benches only)", "rate", s.Rate, "epoch", s.Epoch)
	return clk, nil
}

// checkSchema applies migrations when asked and refuses a database newer
// than the binary either way.
func checkSchema(ctx context.Context, cfg Config, logger *slog.Logger) error {
	url := cfg.ListenURL // migrations take a session lock: prefer the direct URL
	if url == "" {
		url = cfg.DatabaseURL
	}
	db, err := migrations.Open(url)
	if err != nil {
		return err
	}
	defer db.Close()
	var st migrations.Status
	if cfg.Migrate {
		st, err = migrations.Up(ctx, db, logger)
	} else {
		st, err = migrations.Check(ctx, db)
	}
	if err != nil {
		return fmt.Errorf("schema: %w", err)
	}
	if st.Pending > 0 {
		logger.Warn("database has pending migrations; run with --migrate or `make migrate`", "current", st.Current, "target", st.Target, "pending", st.Pending)
	}
	return nil
}
