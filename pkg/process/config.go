// Package process is the shared skeleton of every leasehold service's main:
// flags with LEASEHOLD_* environment fallbacks, a slog logger, a Prometheus
// registry, OpenTelemetry tracing (off unless the OTEL_* environment turns
// it on; flushed on exit), the pgx pool and optional migrations (unless the
// service needs no database: Spec.NoDatabase), the health
// endpoints, and a dskit services.Manager that starts the service's components and stops
// them on SIGTERM or when any of them fails.
package process

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/leasehold/leasehold/pkg/clock"
	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgdb"
)

// EnvPrefix prefixes the environment variable of every flag: flag
// "database-url" is LEASEHOLD_DATABASE_URL. A flag given on the command line
// wins over the environment.
const EnvPrefix = "LEASEHOLD_"

// Config is what every service process needs.
type Config struct {
	// DatabaseURL is the pool's PostgreSQL URL (may go through PgBouncer).
	DatabaseURL string
	// ListenURL is a direct (session) URL for LISTEN; empty means
	// DatabaseURL unless Pooler is set, in which case notifications are off
	// and every waiter polls.
	ListenURL string
	// Pooler marks DatabaseURL as going through a transaction-mode pooler.
	Pooler bool
	// MaxConns caps the pool.
	MaxConns int
	// HTTPAddr serves /livez, /readyz, /healthz/detail and /metrics.
	HTTPAddr string
	// HealthToken is the bearer token of /healthz/detail.
	HealthToken string
	// Migrate applies pending migrations at start.
	Migrate bool
	// ID is this process's identity: lease owner and workers row id.
	ID string
	// LogLevel is debug, info, warn or error.
	LogLevel string
	// LogFormat is json or text.
	LogFormat string
	// ShutdownTimeout bounds a graceful stop.
	ShutdownTimeout time.Duration
	// ClockRate and ClockEpoch install a scaled clock (benches and
	// simulators only, docs/design.md#time): simulated time runs ClockRate
	// times faster than wall time from ClockEpoch (RFC 3339). Rate 1 is the
	// real clock.
	ClockRate  float64
	ClockEpoch string
}

// RegisterFlags registers the common flags on f, each name under prefix;
// --http-addr defaults to c.HTTPAddr (the service's health address) and
// --shutdown-timeout to c.ShutdownTimeout when set (90 s otherwise).
func (c *Config) RegisterFlags(prefix string, f *flag.FlagSet) {
	f.StringVar(&c.DatabaseURL, prefix+"database-url", "", "PostgreSQL URL (env LEASEHOLD_DATABASE_URL)")
	f.StringVar(&c.ListenURL, prefix+"listen-database-url", "", "direct PostgreSQL URL for LISTEN when --database-url goes through a transaction pooler")
	f.BoolVar(&c.Pooler, prefix+"pooler", false, "--database-url goes through PgBouncer in transaction mode")
	f.IntVar(&c.MaxConns, prefix+"db-max-conns", 10, "maximum connections in the pool")
	f.BoolVar(&c.Migrate, prefix+"migrate", false, "apply pending database migrations at start")
	f.StringVar(&c.ID, prefix+"id", "", "process id used as lease owner (default: generated)")
	c.registerServerFlags(prefix, f)
	f.Float64Var(&c.ClockRate, prefix+"clock.rate", 1, "benches only: run timers this many times faster than wall time (the database's compute_now() must be scaled alike: pkg/clock.InstallSQL)")
	f.StringVar(&c.ClockEpoch, prefix+"clock.epoch", "", "benches only: RFC 3339 instant at which the scaled and wall clocks agree (needed with --clock.rate > 1)")
}

// registerServerFlags registers the flags every process has, with or
// without a database: health server, logging and graceful stop.
func (c *Config) registerServerFlags(prefix string, f *flag.FlagSet) {
	shutdown := c.ShutdownTimeout
	if shutdown <= 0 {
		shutdown = 90 * time.Second
	}
	f.StringVar(&c.HTTPAddr, prefix+"http-addr", c.HTTPAddr, "address of /livez, /readyz, /healthz/detail and /metrics")
	f.StringVar(&c.HealthToken, prefix+"health-token", "", "bearer token for /healthz/detail (empty disables it)")
	f.StringVar(&c.LogLevel, prefix+"log-level", "info", "log level: debug, info, warn, error")
	f.StringVar(&c.LogFormat, prefix+"log-format", "json", "log format: json or text")
	f.DurationVar(&c.ShutdownTimeout, prefix+"shutdown-timeout", shutdown, "how long a graceful stop may take")
}

// Scale is the clock scale of --clock.rate and --clock.epoch (rate 1: the
// real clock).
func (c *Config) Scale() (clock.Scale, error) {
	if c.ClockRate == 1 && c.ClockEpoch == "" {
		return clock.Scale{Rate: 1}, nil
	}
	epoch, err := time.Parse(time.RFC3339Nano, c.ClockEpoch)
	if err != nil {
		return clock.Scale{}, fmt.Errorf("--clock.epoch %q: want an RFC 3339 time: %w", c.ClockEpoch, err)
	}
	s := clock.Scale{Epoch: epoch, Rate: c.ClockRate}
	if err := s.Validate(); err != nil {
		return clock.Scale{}, fmt.Errorf("--clock.rate / --clock.epoch: %w", err)
	}
	return s, nil
}

// Validate checks the configuration and names the offending flag.
func (c *Config) Validate() error {
	var errs []error
	if c.DatabaseURL == "" {
		errs = append(errs, errors.New("--database-url (LEASEHOLD_DATABASE_URL) is required; `make run` starts a local cluster and sets it"))
	} else if err := pgdb.CheckURL(c.DatabaseURL, "--database-url"); err != nil {
		errs = append(errs, err)
	}
	if c.ListenURL != "" {
		if err := pgdb.CheckURL(c.ListenURL, "--listen-database-url"); err != nil {
			errs = append(errs, err)
		}
	}
	if c.MaxConns < 1 || c.MaxConns > 1000 {
		errs = append(errs, fmt.Errorf("--db-max-conns %d must be in 1..1000", c.MaxConns))
	}
	if c.ID != "" {
		if err := coord.ValidateOwner(c.ID); err != nil {
			errs = append(errs, fmt.Errorf("--id: %w", err))
		}
	}
	if _, err := c.Scale(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(append(errs, c.validateServer())...)
}

// validateServer checks the flags of registerServerFlags.
func (c *Config) validateServer() error {
	var errs []error
	if c.HTTPAddr == "" {
		errs = append(errs, errors.New("--http-addr is required"))
	}
	switch c.LogLevel {
	case "debug", "info", "warn", "error":
	default:
		errs = append(errs, fmt.Errorf("--log-level %q must be debug, info, warn or error", c.LogLevel))
	}
	switch c.LogFormat {
	case "json", "text":
	default:
		errs = append(errs, fmt.Errorf("--log-format %q must be json or text", c.LogFormat))
	}
	if c.ShutdownTimeout <= 0 {
		errs = append(errs, fmt.Errorf("--shutdown-timeout %s must be positive", c.ShutdownTimeout))
	}
	return errors.Join(errs...)
}

// NotifyURL is the URL LISTEN should use, or "" when notifications are off.
func (c *Config) NotifyURL() string {
	if c.ListenURL != "" {
		return c.ListenURL
	}
	if c.Pooler {
		return ""
	}
	return c.DatabaseURL
}

// ApplyEnv sets every flag of fs not given on the command line from its
// LEASEHOLD_* environment variable, if set.
func ApplyEnv(fs *flag.FlagSet) error {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		if given[f.Name] || noEnv[f.Name] {
			return
		}
		if v, ok := os.LookupEnv(EnvName(f.Name)); ok {
			if err := fs.Set(f.Name, v); err != nil {
				errs = append(errs, fmt.Errorf("%s=%q: %w", EnvName(f.Name), v, err))
			}
		}
	})
	return errors.Join(errs...)
}

// EnvName is the environment variable of flag name.
func EnvName(name string) string {
	return EnvPrefix + strings.ToUpper(strings.NewReplacer("-", "_", ".", "_").Replace(name))
}

// NewID returns prefix followed by 12 random hex digits: a fresh process id.
func NewID(prefix string) string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}
