package coord

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgnotify"
)

// Lease is one held lease as granted by the database.
type Lease struct {
	// Name is the lease row's name.
	Name string
	// Owner is the holder's process id.
	Owner string
	// Epoch is the fencing token: it rose when this owner took the lease.
	Epoch int64
	// ExpiresAt is the database's expiry (compute_now() clock).
	ExpiresAt time.Time
	// GrantedAt is compute_now() when the lease was last granted or renewed.
	GrantedAt time.Time
	// Floor is lease_epoch_floor() at the last grant or Renew (epoch.go): it
	// changes when the database has failed over to a new timeline or a
	// process detected that it went back in time (restore.go), which a
	// Keeper treats as the end of its holding.
	Floor int64
	// TTL is the duration the lease was last granted for.
	TTL time.Duration
	// ValidUntil is the last instant, on the process clock, this process
	// trusts the lease: when the granting statement was sent plus the TTL.
	ValidUntil time.Time
}

// Grant is the result of one AcquireMany statement.
type Grant struct {
	// Leases are the names now held, with their epochs, in no set order.
	Leases []Lease
	// Now is compute_now() as the statement saw it.
	Now time.Time
	// Skew is the process clock minus the database clock, estimated at the
	// midpoint of the round trip.
	Skew time.Duration
	// RoundTrip is how long the statement took.
	RoundTrip time.Duration
}

// Get returns the granted lease called name.
func (g Grant) Get(name string) (Lease, bool) {
	for _, l := range g.Leases {
		if l.Name == name {
			return l, true
		}
	}
	return Lease{}, false
}

// Client acquires, renews and releases leases for one owner (one process).
// It is safe for concurrent use.
type Client struct {
	db    *pgxpool.Pool
	owner string
	clock clockwork.Clock
	skew  *SkewDetector
	known sync.Map // lease names whose rows are known to exist
	// mem is what this client saw of the database's history (restore.go).
	mem          epochMemory
	onRegression func(Regression)
	log          *slog.Logger // nil: the Keeper's or Renewer's, else slog.Default()
}

// ClientOption configures a Client.
type ClientOption func(*Client)

// WithClock sets the process clock (default: the real clock).
func WithClock(c clockwork.Clock) ClientOption { return func(cl *Client) { cl.clock = c } }

// WithSkewDetector observes every statement's compute_now() for clock skew.
func WithSkewDetector(d *SkewDetector) ClientOption { return func(cl *Client) { cl.skew = d } }

// NewClient returns a lease client acting as owner.
func NewClient(db *pgxpool.Pool, owner string, opts ...ClientOption) (*Client, error) {
	if err := ValidateOwner(owner); err != nil {
		return nil, err
	}
	c := &Client{db: db, owner: owner, clock: clockwork.NewRealClock()}
	for _, o := range opts {
		o(c)
	}
	return c, nil
}

// Owner is the owner id this client acts as.
func (c *Client) Owner() string { return c.owner }

// Pool is the client's pool.
func (c *Client) Pool() *pgxpool.Pool { return c.db }

const insertMissingSQL = `
INSERT INTO leases (name, owner, epoch, expires_at)
SELECT n, NULL, 0, '-infinity' FROM unnest($1::text[]) AS n
ON CONFLICT (name) DO NOTHING`

// AcquireMany takes or renews every name in one guarded statement
// (acquireSQL, restore.go: the guarded UPDATE of docs/design.md#leases with
// the epoch rule of epoch.go): a name is granted when this owner already
// holds it or its lease has expired. Names held live by another owner are
// simply absent from the grant. Rows missing from the table are first
// inserted unowned and expired, in the same round trip, so the first holder
// gets epoch 1. The statement returns compute_now() even when nothing was
// granted, so every call samples the clock for skew detection. A database
// found behind what this client saw is recorded and the statement sent
// again (restore.go).
func (c *Client) AcquireMany(ctx context.Context, names []string, ttl time.Duration) (Grant, error) {
	if err := ValidateNames(names); err != nil {
		return Grant{}, err
	}
	if err := ValidateTTL(ttl); err != nil {
		return Grant{}, err
	}
	var missing []string
	for _, n := range names {
		if _, ok := c.known.Load(n); !ok {
			missing = append(missing, n)
		}
	}
	grant, sent, err := c.grantGuarded(ctx, acquireSQL, names, missing, ttl)
	if err != nil {
		return Grant{}, fmt.Errorf("acquire %d leases as %s: %w", len(names), c.owner, err)
	}
	grant.RoundTrip = c.clock.Since(sent)
	grant.Skew = sent.Add(grant.RoundTrip / 2).Sub(grant.Now)
	if c.skew != nil && !grant.Now.IsZero() {
		c.skew.Observe(grant.Skew)
	}
	return grant, nil
}

// Acquire takes or renews one lease; ok is false when another owner holds it.
func (c *Client) Acquire(ctx context.Context, name string, ttl time.Duration) (Lease, bool, error) {
	g, err := c.AcquireMany(ctx, []string{name}, ttl)
	if err != nil {
		return Lease{}, false, err
	}
	l, ok := g.Get(name)
	return l, ok, nil
}

const releaseSQL = `
WITH released AS (
  UPDATE leases SET owner = NULL, expires_at = '-infinity'
  WHERE name = ANY($1::text[]) AND owner = $2
  RETURNING name
)
SELECT name, pg_notify('` + pgnotify.LeaseReleased + `', name) FROM released`

// Release gives up the names this owner holds, in one statement, so a
// successor need not wait for the TTL, and NOTIFYs each released name on
// pgnotify.LeaseReleased. Names held by others are untouched. It returns the names
// actually released.
func (c *Client) Release(ctx context.Context, names ...string) ([]string, error) {
	if len(names) == 0 {
		return nil, nil
	}
	if err := ValidateNames(names); err != nil {
		return nil, err
	}
	rows, err := c.db.Query(ctx, releaseSQL, names, c.owner)
	if err != nil {
		return nil, fmt.Errorf("release %d leases as %s: %w", len(names), c.owner, err)
	}
	released, err := collectReleased(rows)
	if err != nil {
		return nil, fmt.Errorf("release %d leases as %s: %w", len(names), c.owner, err)
	}
	return released, nil
}

// collectReleased reads the (name, pg_notify result) rows of a release.
func collectReleased(rows pgx.Rows) ([]string, error) {
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (string, error) {
		var n string
		var ignored any
		return n, r.Scan(&n, &ignored)
	})
}

const releaseAllSQL = `
WITH released AS (
  UPDATE leases SET owner = NULL, expires_at = '-infinity' WHERE owner = $1 RETURNING name
)
SELECT name, pg_notify('` + pgnotify.LeaseReleased + `', name) FROM released`

// ReleaseAll releases every lease this owner holds (self-release, shutdown).
func (c *Client) ReleaseAll(ctx context.Context) ([]string, error) {
	return c.releaseAll(ctx, c.db)
}

func (c *Client) releaseAll(ctx context.Context, q pgdb.Querier) ([]string, error) {
	rows, err := q.Query(ctx, releaseAllSQL, c.owner)
	if err != nil {
		return nil, fmt.Errorf("release all leases of %s: %w", c.owner, err)
	}
	released, err := collectReleased(rows)
	if err != nil {
		return nil, fmt.Errorf("release all leases of %s: %w", c.owner, err)
	}
	return released, nil
}

// LeaveAndReleaseAll deletes the owner's workers rows and releases every
// lease it holds in one transaction: the NOTIFYs go out at commit, when
// survivors already see the member gone, so their very next pass takes
// its shards.
func (c *Client) LeaveAndReleaseAll(ctx context.Context, rowIDs []string) ([]string, error) {
	var released []string
	err := pgdb.InTx(ctx, c.db, func(tx pgx.Tx) error {
		if err := Leave(ctx, tx, rowIDs...); err != nil {
			return err
		}
		var err error
		released, err = c.releaseAll(ctx, tx)
		return err
	})
	return released, err
}
