package reconcile

import (
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/queue"
)

// Config tunes the runtime.
type Config struct {
	// Timings are the lease and membership durations.
	Timings coord.Timings
	// ClaimTTL is how long a claimed key stays claimed (60 s); it must exceed
	// the longest reconcile.
	ClaimTTL time.Duration
	// Batch is how many keys one claim takes (small, so a crash strands few
	// keys until their claims expire).
	Batch int
	// Poll is how often an idle reconciler looks for due keys.
	Poll time.Duration
	// SelfReleaseAfter: a loop stalled this long makes the process release
	// every lease and fail /livez.
	SelfReleaseAfter time.Duration
	// StatementTimeout bounds each statement of a fenced transaction.
	StatementTimeout time.Duration
	// Backoff spaces the retries of a failing key.
	Backoff queue.Backoff
	// Version is reported on the workers rows.
	Version string
	// Liveness turns on the liveness session (pkg/coord/liveness.go) when a
	// direct database URL exists for it (the LISTEN URL): survivors then
	// take over a dead member in SelfFence + Margin + a ping instead of a
	// TTL. Behind a transaction pooler without a direct URL the TTL path
	// alone applies.
	Liveness bool
	// LivenessTimings are the session's ping, self-fence deadline and margin.
	LivenessTimings coord.LivenessConfig
}

// DefaultConfig is DESIGN.md's defaults.
func DefaultConfig() Config {
	return Config{
		Timings:          coord.DefaultTimings(),
		ClaimTTL:         60 * time.Second,
		Batch:            10,
		Poll:             500 * time.Millisecond,
		SelfReleaseAfter: 30 * time.Second,
		StatementTimeout: coord.DefaultStatementTimeout,
		Backoff:          queue.Backoff{Base: queue.DefaultBackoffBase, Max: queue.DefaultBackoffMax},
		Liveness:         true,
		LivenessTimings:  coord.DefaultLiveness(),
	}
}

// RegisterFlags registers the runtime's flags under prefix ("coord.").
func (c *Config) RegisterFlags(prefix string, f *flag.FlagSet) {
	f.DurationVar(&c.Timings.LeaseTTL, prefix+"lease-ttl", c.Timings.LeaseTTL, "shard and singleton lease TTL")
	f.DurationVar(&c.Timings.Renew, prefix+"renew-interval", c.Timings.Renew, "membership pass period (renewMs); must be below lease-ttl/2")
	f.DurationVar(&c.Timings.LiveWindow, prefix+"live-window", c.Timings.LiveWindow, "a member is live while it heartbeated this recently; must exceed lease-ttl")
	f.DurationVar(&c.Timings.ForgetAfter, prefix+"forget-after", c.Timings.ForgetAfter, "delete workers rows silent this long")
	f.DurationVar(&c.ClaimTTL, prefix+"claim-ttl", c.ClaimTTL, "how long a claimed work-queue key stays claimed; must exceed the longest reconcile")
	f.IntVar(&c.Batch, prefix+"claim-batch", c.Batch, "keys per claim")
	f.DurationVar(&c.Poll, prefix+"poll-interval", c.Poll, "how often an idle reconciler looks for due keys")
	f.DurationVar(&c.SelfReleaseAfter, prefix+"self-release-after", c.SelfReleaseAfter, "release every lease and fail /livez when a loop stalls this long")
	f.DurationVar(&c.StatementTimeout, prefix+"statement-timeout", c.StatementTimeout, "statement timeout inside fenced transactions")
	c.Backoff.RegisterFlags(prefix+"retry-", f)
	f.BoolVar(&c.Liveness, prefix+"liveness", c.Liveness, "keep a liveness session on the direct database URL so survivors take over a dead member in seconds (off, or without a direct URL: the TTL path alone)")
	f.DurationVar(&c.LivenessTimings.Ping, prefix+"liveness-ping", c.LivenessTimings.Ping, "liveness session ping period; at most half of liveness-self-fence")
	f.DurationVar(&c.LivenessTimings.SelfFence, prefix+"liveness-self-fence", c.LivenessTimings.SelfFence, "stop trusting every lease this long after the last successful liveness ping was sent")
	f.DurationVar(&c.LivenessTimings.Margin, prefix+"liveness-margin", c.LivenessTimings.Margin, "survivors wait liveness-self-fence plus this after a member's liveness session ends before releasing its leases")
}

// Validate refuses a configuration that breaks an ordering, naming both values.
func (c Config) Validate() error {
	errs := []error{c.Timings.Validate(), c.Backoff.Validate()}
	if c.Liveness {
		lc := c.LivenessTimings
		lc.URL = "checked" // the timings are checked whether or not a direct URL turns up
		if err := lc.Validate(c.Timings.LeaseTTL); err != nil {
			errs = append(errs, fmt.Errorf("--coord.liveness-*: %w", err))
		}
	}
	if c.ClaimTTL <= c.StatementTimeout {
		errs = append(errs, fmt.Errorf("claim TTL %s must exceed the statement timeout %s", c.ClaimTTL, c.StatementTimeout))
	}
	if c.Batch < 1 || c.Batch > 1000 {
		errs = append(errs, fmt.Errorf("claim batch %d must be in 1..1000", c.Batch))
	}
	if c.Poll <= 0 {
		errs = append(errs, fmt.Errorf("poll interval %s must be positive", c.Poll))
	}
	if c.SelfReleaseAfter <= c.Timings.Renew {
		errs = append(errs, fmt.Errorf("self-release-after %s must exceed the renew interval %s", c.SelfReleaseAfter, c.Timings.Renew))
	}
	if c.StatementTimeout <= 0 {
		errs = append(errs, fmt.Errorf("statement timeout %s must be positive", c.StatementTimeout))
	}
	return errors.Join(errs...)
}
