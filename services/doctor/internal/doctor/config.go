package doctor

import (
	"errors"
	"flag"
	"fmt"
	"strings"
	"time"

	"github.com/leasehold/leasehold/pkg/buildinfo"
)

// Config holds the thresholds and the expected deployment the checks compare
// the database against. Its defaults are the timings of docs/design.md#timings.
type Config struct {
	// LeaseTTL is the shard and singleton lease TTL: a member silent this
	// long is silent, and a fenced transaction older than it is long.
	LeaseTTL time.Duration
	// LiveWindow is how recent a heartbeat keeps a member in the live set.
	LiveWindow time.Duration
	// QueueOverdue is how late work may be before workers.queue fires.
	QueueOverdue time.Duration
	// WorkerAlive is how recent a heartbeat must be for a worker to count as
	// alive in workers.queue.
	WorkerAlive time.Duration
	// SweeperJob is the periodic singleton workers.sweeper watches.
	SweeperJob string
	// SweeperStalePeriods is how many periods without a completion make the
	// sweeper stale.
	SweeperStalePeriods int
	// MaxStreams is the gateways' --gateway.max-streams.
	MaxStreams int
	// Regions maps gateway ids to regions for gateways.headroom.
	Regions Regions
	// Expect* are the configured process counts for db.connections; a
	// negative value means "what the database shows now".
	ExpectWorkers, ExpectSchedulers, ExpectGateways, ExpectAPIs, ExpectSiteAgents int
	// ExpectPoolSize is each process's --db-max-conns.
	ExpectPoolSize int
	// CheckTimeout bounds every statement of a check.
	CheckTimeout time.Duration
	// TLSCertFiles are PEM files whose certificates tls.expiry checks.
	TLSCertFiles certFiles
	// TLSExpiryWarn and TLSExpiryCritical are how close to its NotAfter a
	// certificate makes tls.expiry warn and critical.
	TLSExpiryWarn, TLSExpiryCritical time.Duration
	// MinDaemonVersion is the gateways' --gateway.min-daemon-version:
	// nodes.versions warns about nodes below it ("" lists versions only).
	MinDaemonVersion string
}

// RegisterFlags registers the doctor's flags on f, each name under prefix, with their defaults.
func (c *Config) RegisterFlags(prefix string, f *flag.FlagSet) {
	f.DurationVar(&c.LeaseTTL, prefix+"lease-ttl", 15*time.Second, "shard and singleton lease TTL of the workers (silent members, long fenced transactions)")
	f.DurationVar(&c.LiveWindow, prefix+"live-window", 30*time.Second, "live worker window of the workers")
	f.DurationVar(&c.QueueOverdue, prefix+"queue-overdue", 5*time.Minute, "work overdue longer than this is reported by workers.queue")
	f.DurationVar(&c.WorkerAlive, prefix+"worker-alive", time.Minute, "a worker that heartbeated within this is alive (workers.queue)")
	f.StringVar(&c.SweeperJob, prefix+"sweeper-job", "sweeper", "periodic singleton watched by workers.sweeper")
	f.IntVar(&c.SweeperStalePeriods, prefix+"sweeper-stale-periods", 3, "periods without a completed sweep before workers.sweeper warns")
	f.IntVar(&c.MaxStreams, prefix+"max-streams", 5000, "the gateways' --gateway.max-streams (gateways.headroom)")
	f.Var(&c.Regions, prefix+"regions", "gateway regions for gateways.headroom: comma-separated gateway=region, a trailing * matches a prefix (gw-eu-*=eu); unmapped gateways are in region \"default\"")
	f.IntVar(&c.ExpectWorkers, prefix+"expect-workers", -1, "worker processes the deployment runs (db.connections; -1: the live ones)")
	f.IntVar(&c.ExpectSchedulers, prefix+"expect-schedulers", -1, "scheduler processes (-1: the live ones)")
	f.IntVar(&c.ExpectGateways, prefix+"expect-gateways", -1, "gateway processes (-1: the live ones)")
	f.IntVar(&c.ExpectAPIs, prefix+"expect-api", 0, "api processes")
	f.IntVar(&c.ExpectSiteAgents, prefix+"expect-site-agents", 0, "site-agent processes that connect to the database")
	f.IntVar(&c.ExpectPoolSize, prefix+"expect-pool-size", 10, "each process's --db-max-conns")
	f.DurationVar(&c.CheckTimeout, prefix+"check-timeout", 10*time.Second, "statement timeout of each check")
	f.Var(&c.TLSCertFiles, prefix+"tls-cert-files", "comma-separated PEM files (serving certificates, client CA bundles) whose expiry tls.expiry checks")
	f.DurationVar(&c.TLSExpiryWarn, prefix+"tls-expiry-warn", 14*24*time.Hour, "a certificate expiring within this makes tls.expiry warn")
	f.StringVar(&c.MinDaemonVersion, prefix+"min-daemon-version", "", "the gateways' --gateway.min-daemon-version: nodes.versions warns about nodes below it (empty: list versions only)")
	f.DurationVar(&c.TLSExpiryCritical, prefix+"tls-expiry-critical", 3*24*time.Hour, "a certificate expiring within this makes tls.expiry critical")
}

// DefaultConfig returns the configuration RegisterFlags would produce.
func DefaultConfig() Config {
	var c Config
	c.RegisterFlags("", flag.NewFlagSet("defaults", flag.ContinueOnError))
	return c
}

// Validate refuses values the checks cannot use, naming the flag.
func (c *Config) Validate() error {
	var errs []error
	positive := func(name string, d time.Duration) {
		if d <= 0 {
			errs = append(errs, fmt.Errorf("--%s %s must be positive", name, d))
		}
	}
	positive("lease-ttl", c.LeaseTTL)
	positive("live-window", c.LiveWindow)
	positive("queue-overdue", c.QueueOverdue)
	positive("worker-alive", c.WorkerAlive)
	positive("check-timeout", c.CheckTimeout)
	if c.LeaseTTL > 0 && c.LiveWindow <= c.LeaseTTL {
		errs = append(errs, fmt.Errorf("--live-window %s must be longer than --lease-ttl %s", c.LiveWindow, c.LeaseTTL))
	}
	positive("tls-expiry-critical", c.TLSExpiryCritical)
	if c.TLSExpiryWarn < c.TLSExpiryCritical {
		errs = append(errs, fmt.Errorf("--tls-expiry-warn %s must not be shorter than --tls-expiry-critical %s", c.TLSExpiryWarn, c.TLSExpiryCritical))
	}
	if c.MinDaemonVersion != "" && buildinfo.Release(c.MinDaemonVersion) == "" {
		errs = append(errs, fmt.Errorf("--min-daemon-version %q is not a semantic version (vMAJOR[.MINOR[.PATCH]])", c.MinDaemonVersion))
	}
	if c.SweeperJob == "" {
		errs = append(errs, errors.New("--sweeper-job must not be empty"))
	}
	if c.SweeperStalePeriods < 1 {
		errs = append(errs, fmt.Errorf("--sweeper-stale-periods %d must be at least 1", c.SweeperStalePeriods))
	}
	if c.MaxStreams < 1 {
		errs = append(errs, fmt.Errorf("--max-streams %d must be at least 1", c.MaxStreams))
	}
	if c.ExpectPoolSize < 1 {
		errs = append(errs, fmt.Errorf("--expect-pool-size %d must be at least 1", c.ExpectPoolSize))
	}
	for name, v := range map[string]int{"expect-api": c.ExpectAPIs, "expect-site-agents": c.ExpectSiteAgents} {
		if v < 0 {
			errs = append(errs, fmt.Errorf("--%s %d must not be negative", name, v))
		}
	}
	return errors.Join(errs...)
}

// Regions maps gateway ids to regions: exact ids first, then the longest
// matching prefix pattern ("gw-eu-*").
type Regions struct {
	exact    map[string]string
	prefixes []regionPrefix
	raw      string
}

type regionPrefix struct{ prefix, region string }

// String returns the flag's value as given.
func (r *Regions) String() string { return r.raw }

// Set parses "gw-a=eu,gw-b=eu,gw-us-*=us".
func (r *Regions) Set(v string) error {
	parsed := Regions{exact: map[string]string{}, raw: v}
	for item := range strings.SplitSeq(v, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		gw, region, ok := strings.Cut(item, "=")
		gw, region = strings.TrimSpace(gw), strings.TrimSpace(region)
		if !ok || gw == "" || region == "" {
			return fmt.Errorf("region mapping %q: want gateway=region", item)
		}
		if p, isPrefix := strings.CutSuffix(gw, "*"); isPrefix {
			parsed.prefixes = append(parsed.prefixes, regionPrefix{p, region})
			continue
		}
		parsed.exact[gw] = region
	}
	*r = parsed
	return nil
}

// Of returns the region of gateway id ("default" when unmapped).
func (r *Regions) Of(id string) string {
	if reg, ok := r.exact[id]; ok {
		return reg
	}
	best, bestLen := "default", -1
	for _, p := range r.prefixes {
		if strings.HasPrefix(id, p.prefix) && len(p.prefix) > bestLen {
			best, bestLen = p.region, len(p.prefix)
		}
	}
	return best
}
