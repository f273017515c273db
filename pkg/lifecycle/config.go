package lifecycle

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"
)

// EnvPrefix prefixes the environment variable of every flag: flag
// "database-url" is LEASEHOLD_DATABASE_URL. A flag given on the command line
// wins over the environment.
const EnvPrefix = "LEASEHOLD_"

// Config is what every leasehold process has, with or without a database:
// its health server, logging, graceful stop and identity.
type Config struct {
	// HTTPAddr serves /livez, /readyz, /healthz/detail and /metrics.
	HTTPAddr string
	// HealthToken is the bearer token of /healthz/detail.
	HealthToken string
	// LogLevel is debug, info, warn or error.
	LogLevel string
	// LogFormat is json or text.
	LogFormat string
	// ShutdownTimeout bounds a graceful stop.
	ShutdownTimeout time.Duration
	// ID is this process's identity (lease owner, log tag).
	ID string
	// InsecurePlaintext lets the program's listeners (Spec.Listeners) serve
	// plaintext on addresses other than loopback (CheckPlaintext).
	InsecurePlaintext bool
}

// RegisterFlags registers the flags of Config on f, each name under
// prefix; --http-addr defaults to c.HTTPAddr and --shutdown-timeout to
// c.ShutdownTimeout when set (90 s otherwise). ID has no flag here: a
// program names itself through Spec.Identity, a database service by --id.
func (c *Config) RegisterFlags(prefix string, f *flag.FlagSet) {
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

// RegisterPlaintextFlag registers --insecure-plaintext on f, under prefix:
// only a program with listeners that carry credentials or commands
// (Spec.Listeners) has it.
func (c *Config) RegisterPlaintextFlag(prefix string, f *flag.FlagSet) {
	f.BoolVar(&c.InsecurePlaintext, prefix+InsecurePlaintextFlag, false, "let listeners that carry credentials or commands serve without TLS on addresses other than loopback (behind a TLS-terminating proxy only)")
}

// Validate checks the flags of RegisterFlags and names the offending one.
func (c *Config) Validate() error {
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

// ApplyEnv sets every flag of fs not given on the command line from its
// LEASEHOLD_* environment variable, if set (never --version).
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
