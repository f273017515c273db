// Package process is the shared skeleton of every control-plane service's
// main: pkg/lifecycle (flags with LEASEHOLD_* environment fallbacks, a slog
// logger, a Prometheus registry, the health endpoints, a dskit
// services.Manager stopped on SIGTERM or when a component fails) plus what a
// service with a database needs: the pgx pool, the schema check or
// migrations, the scaled clock of benches, and OpenTelemetry tracing (off
// unless the OTEL_* environment turns it on; flushed on exit). Programs
// without a database (the node and site agents) use pkg/lifecycle alone.
package process

import (
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/leasehold/leasehold/pkg/clock"
	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/lifecycle"
	"github.com/leasehold/leasehold/pkg/pgdb"
)

// Config is what every service process with a database needs: the common
// configuration of pkg/lifecycle (health server, logging, graceful stop,
// ID) and the database's.
type Config struct {
	lifecycle.Config
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
	// Migrate applies pending migrations at start.
	Migrate bool
	// ClockRate and ClockEpoch install a scaled clock (benches and
	// simulators only, docs/design.md#time): simulated time runs ClockRate
	// times faster than wall time from ClockEpoch (RFC 3339). Rate 1 is the
	// real clock.
	ClockRate  float64
	ClockEpoch string
}

// RegisterFlags registers the common flags on f, each name under prefix:
// the database's (--database-url, --id, --clock.* and the rest) and
// lifecycle's (--http-addr, defaulting to c.HTTPAddr, and the rest).
func (c *Config) RegisterFlags(prefix string, f *flag.FlagSet) {
	c.registerDatabaseFlags(prefix, f)
	c.Config.RegisterFlags(prefix, f)
}

// registerDatabaseFlags registers the flags only a service with a database
// has; --id names it as a lease owner.
func (c *Config) registerDatabaseFlags(prefix string, f *flag.FlagSet) {
	f.StringVar(&c.DatabaseURL, prefix+"database-url", "", "PostgreSQL URL (env LEASEHOLD_DATABASE_URL)")
	f.StringVar(&c.ListenURL, prefix+"listen-database-url", "", "direct PostgreSQL URL for LISTEN when --database-url goes through a transaction pooler")
	f.BoolVar(&c.Pooler, prefix+"pooler", false, "--database-url goes through PgBouncer in transaction mode")
	f.IntVar(&c.MaxConns, prefix+"db-max-conns", 10, "maximum connections in the pool")
	f.BoolVar(&c.Migrate, prefix+"migrate", false, "apply pending database migrations at start")
	f.StringVar(&c.ID, prefix+"id", "", "process id used as lease owner (default: generated)")
	f.Float64Var(&c.ClockRate, prefix+"clock.rate", 1, "benches only: run timers this many times faster than wall time (the database's compute_now() must be scaled alike: pkg/clock.InstallSQL)")
	f.StringVar(&c.ClockEpoch, prefix+"clock.epoch", "", "benches only: RFC 3339 instant at which the scaled and wall clocks agree (needed with --clock.rate > 1)")
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
	return errors.Join(c.validateDatabase(), c.Config.Validate())
}

// validateDatabase checks the flags of registerDatabaseFlags.
func (c *Config) validateDatabase() error {
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
