// Package siteboot holds each bare-metal site's boot lease, site:<id>:boot
// (docs/design.md#site-agents), on behalf of one connected site agent, and publishes
// the grant into the agents' NodeSpecs.
//
// The lease's owner is the agent's node id: the agent is the holder, and the
// worker that holds the site's shard renews the lease for it on every pass
// of the "sites" reconciler, in the transaction fenced on that shard. States
// of one site's lease, as a pass sees them:
//
//	live, holder connected ──────────▶ renew (epoch unchanged), publish a fresh grant to the holder
//	live, holder not connected ──────▶ nothing: the lease runs out, the holder's last grant ages out
//	expired, old holder connected ───▶ re-take for the same holder (epoch unchanged)
//	expired < promote-after ago ─────▶ wait (fence before promote)
//	expired >= promote-after ago ────▶ promote the first connected agent by node id (epoch + 1)
//
// The grant is the typed NodeSpec.site_boot: {active, epoch, site_id,
// lease_ttl, promote_after}, plus granted_at (compute_now() of the renewal)
// and expires_at for the holder. An agent answers only within its
// self-fence window (10 s) of granted_at, strictly before the lease, renewed
// at granted_at, can expire (15 s), and a standby is promoted only after
// that expiry: self-fence < TTL <= promote-after.
//
// For one release the grant is also published as the site.boot.* attributes
// that site agents before the typed fields read (Attr*); the next release
// drops them (docs/decisions.md, "Typed site boot grant").
package siteboot

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/leasehold/leasehold/pkg/coord"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/queue"
	"github.com/leasehold/leasehold/pkg/reconcile"
)

// Reconciler is the work_queue reconciler name of site keys.
const Reconciler = "sites"

// Attribute keys of the grant in NodeSpec.attributes, kept for one release
// for agents that predate the typed SiteBoot fields.
const (
	AttrGrantedAt    = "site.boot.granted_at"
	AttrExpiresAt    = "site.boot.expires_at"
	AttrLeaseTTLMs   = "site.boot.lease_ttl_ms"
	AttrPromoteMs    = "site.boot.promote_after_ms"
	AttrHolder       = "site.boot.holder"
	grantedAtLayout  = time.RFC3339Nano
	maxSiteIDLen     = 194 // "site:" + id + ":boot" fits the 200-byte lease name
	defaultScanLimit = 10000
)

// LeaseName is the boot lease of site id (coord.SiteBootLease).
func LeaseName(siteID string) string { return coord.SiteBootLease(siteID) }

// Config holds the boot lease timings.
type Config struct {
	// LeaseTTL is site:<id>:boot's TTL (15 s).
	LeaseTTL time.Duration
	// PromoteAfter is the least time between the holder's last renewal and
	// the promotion of another agent (15 s); it must be >= LeaseTTL.
	PromoteAfter time.Duration
	// RenewEvery is how often a site's key runs while it has a holder (3 s):
	// each run renews the lease and refreshes the holder's grant.
	RenewEvery time.Duration
	// ScanEvery is the period of the scan that enqueues every site (5 s).
	ScanEvery time.Duration
	// ScanLimit bounds the sites one scan enqueues.
	ScanLimit int
}

// DefaultConfig is the defaults of docs/design.md#timings.
func DefaultConfig() Config {
	return Config{LeaseTTL: 15 * time.Second, PromoteAfter: 15 * time.Second, RenewEvery: 3 * time.Second,
		ScanEvery: 5 * time.Second, ScanLimit: defaultScanLimit}
}

// RegisterFlags registers the flags under prefix ("sites.").
func (c *Config) RegisterFlags(prefix string, f *flag.FlagSet) {
	f.DurationVar(&c.LeaseTTL, prefix+"boot-lease-ttl", c.LeaseTTL, "TTL of each site:<id>:boot lease")
	f.DurationVar(&c.PromoteAfter, prefix+"promote-after", c.PromoteAfter, "least time from the boot holder's last renewal to the promotion of a standby; must be >= boot-lease-ttl")
	f.DurationVar(&c.RenewEvery, prefix+"renew-interval", c.RenewEvery, "how often a site's boot lease is renewed and its grant re-published; must be <= boot-lease-ttl/3")
	f.DurationVar(&c.ScanEvery, prefix+"scan-interval", c.ScanEvery, "how often every site with agents is enqueued")
	f.IntVar(&c.ScanLimit, prefix+"scan-limit", c.ScanLimit, "sites one scan enqueues at most")
}

// Validate refuses a configuration that breaks an ordering, naming both values.
func (c Config) Validate() error {
	var errs []error
	if err := coord.ValidateTTL(c.LeaseTTL); err != nil {
		errs = append(errs, fmt.Errorf("--sites.boot-lease-ttl: %w", err))
	}
	if c.PromoteAfter < c.LeaseTTL {
		errs = append(errs, fmt.Errorf("--sites.promote-after %s must be >= --sites.boot-lease-ttl %s (TTL <= promotion)", c.PromoteAfter, c.LeaseTTL))
	}
	if c.RenewEvery < 10*time.Millisecond || c.RenewEvery > c.LeaseTTL/3 {
		errs = append(errs, fmt.Errorf("--sites.renew-interval %s must be >= 10ms and <= a third of --sites.boot-lease-ttl %s", c.RenewEvery, c.LeaseTTL))
	}
	if c.ScanEvery < 10*time.Millisecond || c.ScanEvery%time.Millisecond != 0 {
		errs = append(errs, fmt.Errorf("--sites.scan-interval %s must be whole milliseconds and >= 10ms", c.ScanEvery))
	}
	if c.ScanEvery > c.LeaseTTL/2 {
		errs = append(errs, fmt.Errorf("--sites.scan-interval %s must be <= half of --sites.boot-lease-ttl %s", c.ScanEvery, c.LeaseTTL))
	}
	if c.ScanLimit < 1 {
		errs = append(errs, fmt.Errorf("--sites.scan-limit %d must be >= 1", c.ScanLimit))
	}
	return errors.Join(errs...)
}

type metrics struct {
	renewals   prometheus.Counter
	promotions prometheus.Counter
	lapses     prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		renewals: prometheus.NewCounter(prometheus.CounterOpts{Name: "leasehold_site_boot_renewals_total",
			Help: "Renewals of site:<id>:boot leases for their connected holder."}),
		promotions: prometheus.NewCounter(prometheus.CounterOpts{Name: "leasehold_site_boot_promotions_total",
			Help: "Site boot leases given to a new holder (epoch + 1)."}),
		lapses: prometheus.NewCounter(prometheus.CounterOpts{Name: "leasehold_site_boot_unrenewed_total",
			Help: "Passes that left a live boot lease unrenewed because its holder is not connected."}),
	}
	if reg != nil {
		reg.MustRegister(m.renewals, m.promotions, m.lapses)
	}
	return m
}

// Register adds the site reconciler and the site scan to rt.
func Register(rt *reconcile.Runtime, cfg Config, reg prometheus.Registerer) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	m := newMetrics(reg)
	if err := rt.RegisterSharded(reconcile.Sharded{Name: Reconciler, Group: coord.Controllers,
		Reconcile: func(ctx context.Context, tx pgx.Tx, key string) error {
			_, err := reconcileSite(ctx, tx, key, cfg, m)
			return err
		}}); err != nil {
		return err
	}
	return rt.RegisterPeriodic("site-scan", cfg.ScanEvery, func(ctx context.Context, tx pgx.Tx, _ int64) error {
		_, err := Scan(ctx, tx, cfg)
		return err
	})
}

const scanSQL = `
SELECT DISTINCT site_id FROM nodes
 WHERE kind = 'site_agent' AND site_id IS NOT NULL AND state <> 'revoked'
   AND site_id ~ '^[A-Za-z0-9._:@/-]{1,194}$'
 ORDER BY site_id
 LIMIT $1`

// Scan enqueues every site that has agents and returns how many.
func Scan(ctx context.Context, tx pgx.Tx, cfg Config) (int, error) {
	rows, err := tx.Query(ctx, scanSQL, cfg.ScanLimit)
	if err != nil {
		return 0, fmt.Errorf("scan sites: %w", err)
	}
	sites, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return 0, fmt.Errorf("scan sites: %w", err)
	}
	return queue.EnqueueMany(ctx, tx, Reconciler, sites, 0)
}

// Outcome is what one pass did to a site's lease.
type Outcome struct {
	// Action is renewed, promoted, retaken, waiting, unrenewed or idle.
	Action string
	// Holder and Epoch are the lease's owner and epoch after the pass.
	Holder string
	Epoch  int64
}

// agentsSQL lists the site's agents and whether each has a live session:
// node and session connected, session lease unexpired, and its gateway's
// lease live (a dead gateway's sessions count as gone at once).
var agentsSQL = `
SELECT n.id,
       COALESCE(n.state = 'connected' AND s.state = 'connected' AND s.session_expires_at > compute_now()
                AND ` + coord.GatewayLeaseLive("s.gateway_id") + `, false)
  FROM nodes n
  LEFT JOIN node_sessions s ON s.node_id = n.id
 WHERE n.kind = 'site_agent' AND n.site_id = $1 AND n.state <> 'revoked'
 ORDER BY n.id`

// publishSQL merges site_boot and the site.boot.* attributes into an
// agent's spec, leaving the rest of the spec alone, and writes only when
// something changed (the trigger of migration 00013 then bumps spec_version
// and notifies the gateways).
const publishSQL = `
UPDATE nodes n SET spec = v.spec
  FROM (
    SELECT id, jsonb_set(
             (CASE WHEN jsonb_typeof(spec) = 'object' THEN spec ELSE '{}'::jsonb END - 'siteBoot') || jsonb_build_object('site_boot', $2::jsonb),
             '{attributes}',
             (CASE WHEN jsonb_typeof(spec->'attributes') = 'object' THEN spec->'attributes' ELSE '{}'::jsonb END
                - ARRAY['site.boot.granted_at', 'site.boot.expires_at', 'site.boot.lease_ttl_ms', 'site.boot.promote_after_ms', 'site.boot.holder'])
               || $3::jsonb) AS spec
      FROM nodes WHERE id = $1
  ) v
 WHERE n.id = v.id AND n.spec IS DISTINCT FROM v.spec`

type agent struct {
	id        string
	connected bool
}

// Reconcile runs one pass for siteID inside the caller's transaction, which
// must be fenced on the site's shard lease.
func Reconcile(ctx context.Context, tx pgx.Tx, siteID string, cfg Config) (Outcome, error) {
	return reconcileSite(ctx, tx, siteID, cfg, newMetrics(nil))
}

func reconcileSite(ctx context.Context, tx pgx.Tx, siteID string, cfg Config, m *metrics) (Outcome, error) {
	name := LeaseName(siteID)
	if len(siteID) > maxSiteIDLen || coord.ValidateName(name) != nil {
		return Outcome{Action: "idle"}, nil // the scan never enqueues such ids
	}
	rows, err := tx.Query(ctx, agentsSQL, siteID)
	if err != nil {
		return Outcome{}, fmt.Errorf("read agents of site %s: %w", siteID, err)
	}
	agents, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (agent, error) {
		var a agent
		return a, r.Scan(&a.id, &a.connected)
	})
	if err != nil {
		return Outcome{}, fmt.Errorf("read agents of site %s: %w", siteID, err)
	}
	if len(agents) == 0 {
		return Outcome{Action: "idle"}, nil
	}
	// The lease is read under its row lock: the renewal or take below acts
	// on what was read, and waits for every open fence on the lease first.
	if err := coord.Ensure(ctx, tx, name); err != nil {
		return Outcome{}, err
	}
	h, err := coord.LockForHandover(ctx, tx, name)
	if err != nil {
		return Outcome{}, err
	}
	connected := map[string]bool{}
	for _, a := range agents {
		connected[a.id] = a.connected
	}
	holder, epoch, expiresAt, now := h.Owner, h.Epoch, h.ExpiresAt, h.Now
	live := h.Live()

	var (
		out     Outcome
		granted bool
		newExp  time.Time
		next    = cfg.RenewEvery
	)
	switch {
	case live && connected[holder]:
		l, ok, err := coord.Renew(ctx, tx, coord.Lease{Name: name, Owner: holder, Epoch: epoch}, cfg.LeaseTTL)
		if err != nil {
			return Outcome{}, err
		}
		if !ok { // the row is locked FOR UPDATE above: it cannot have moved
			return Outcome{}, fmt.Errorf("renew %s for %s: the lease changed hands under its row lock", name, holder)
		}
		newExp, now = l.ExpiresAt, l.GrantedAt
		out, granted = Outcome{Action: "renewed", Holder: holder, Epoch: epoch}, true
		m.renewals.Inc()
	case live:
		// The holder keeps the lease until it expires; its last grant ages
		// out on the agent (self-fence) before then. Look again when a
		// promotion may be due, or sooner if it reconnects.
		out = Outcome{Action: "unrenewed", Holder: holder, Epoch: epoch}
		m.lapses.Inc()
		next = min(next, promoteAt(expiresAt, cfg).Sub(now)+10*time.Millisecond)
	default:
		candidate := ""
		action := "promoted"
		if holder != "" && connected[holder] {
			candidate, action = holder, "retaken" // the same agent: nobody to fence against
		} else {
			if at := promoteAt(expiresAt, cfg); now.Before(at) {
				out = Outcome{Action: "waiting", Holder: holder, Epoch: epoch}
				next = at.Sub(now) + 10*time.Millisecond
				break
			}
			for _, a := range agents {
				if a.connected {
					candidate = a.id
					break
				}
			}
		}
		if candidate == "" {
			if out.Action == "" {
				out = Outcome{Action: "idle", Holder: holder, Epoch: epoch}
			}
			break
		}
		l, ok, err := coord.Take(ctx, tx, name, candidate, cfg.LeaseTTL)
		if err != nil {
			return Outcome{}, err
		}
		if !ok {
			return Outcome{}, fmt.Errorf("take %s for %s: the lease is live", name, candidate)
		}
		newEpoch := l.Epoch
		newExp, now = l.ExpiresAt, l.GrantedAt
		holder, epoch, granted = candidate, newEpoch, true
		out = Outcome{Action: action, Holder: holder, Epoch: epoch}
		if action == "promoted" {
			m.promotions.Inc()
		}
	}

	for _, a := range agents {
		if a.id == holder && !granted {
			continue // an unrenewed holder's grant is left to age out
		}
		if err := publish(ctx, tx, a.id, siteID, holder, epoch, granted && a.id == holder, now, newExp, cfg); err != nil {
			return Outcome{}, err
		}
	}
	if out.Holder != "" || out.Action == "waiting" {
		if _, err := queue.Enqueue(ctx, tx, Reconciler, siteID, max(next, 0)); err != nil {
			return Outcome{}, err
		}
	}
	return out, nil
}

// promoteAt is the earliest instant another agent may take a lease that
// expires at expiresAt: the holder's last renewal plus PromoteAfter.
func promoteAt(expiresAt time.Time, cfg Config) time.Time {
	return expiresAt.Add(cfg.PromoteAfter - cfg.LeaseTTL)
}

func publish(ctx context.Context, tx pgx.Tx, nodeID, siteID, holder string, epoch int64, active bool, now, expiresAt time.Time, cfg Config) error {
	grant := &nodev1.SiteBoot{
		Active: active, Epoch: uint64(epoch), SiteId: siteID,
		LeaseTtl: durationpb.New(cfg.LeaseTTL), PromoteAfter: durationpb.New(cfg.PromoteAfter),
	}
	if active {
		grant.GrantedAt, grant.ExpiresAt = timestamppb.New(now), timestamppb.New(expiresAt)
	}
	// protojson with the proto names: the spec is read back by the gateway
	// with protojson into a NodeSpec.
	sb, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(grant)
	if err != nil {
		return fmt.Errorf("encode site boot grant: %w", err)
	}
	attrs := map[string]string{
		AttrHolder:     holder,
		AttrLeaseTTLMs: strconv.FormatInt(cfg.LeaseTTL.Milliseconds(), 10),
		AttrPromoteMs:  strconv.FormatInt(cfg.PromoteAfter.Milliseconds(), 10),
	}
	if active {
		attrs[AttrGrantedAt] = now.UTC().Format(grantedAtLayout)
		attrs[AttrExpiresAt] = expiresAt.UTC().Format(grantedAtLayout)
	}
	ab, err := json.Marshal(attrs)
	if err != nil {
		return err
	}
	// Strings, not []byte: in the pooler's exec mode pgx would send []byte as bytea text.
	if _, err := tx.Exec(ctx, publishSQL, nodeID, string(sb), string(ab)); err != nil {
		return fmt.Errorf("publish site boot grant to %s: %w", nodeID, err)
	}
	return nil
}
