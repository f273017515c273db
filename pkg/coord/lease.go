package coord

import (
	"context"
	"fmt"
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
	// Floor is lease_epoch_floor() at the last Take or Renew (epoch.go): it
	// changes when the database has failed over to a new timeline, which a
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

// acquireSQL is the guarded UPDATE of docs/design.md#leases, with the epoch rule of
// epoch.go. The outer SELECT returns one row with NULLs when nothing was
// granted, so every call samples compute_now() for clock-skew detection
// without a second statement.
var acquireSQL = `
WITH granted AS (
  UPDATE leases SET owner = $2,
    epoch = ` + nextEpochSQL("$2") + `,
    acquired_at = ` + acquiredAtSQL("$2") + `,
    expires_at = compute_now() + make_interval(secs => $3::float8)
  WHERE name = ANY($1::text[]) AND (owner = $2 OR expires_at < compute_now())
  RETURNING name, epoch, expires_at
)
SELECT g.name, g.epoch, g.expires_at, c.now
FROM (SELECT compute_now() AS now) c LEFT JOIN granted g ON true`

// AcquireMany takes or renews every name in one guarded statement: a name is
// granted when this owner already holds it or its lease has expired. Names
// held live by another owner are simply absent from the grant. Rows missing
// from the table are first inserted unowned and expired, in the same
// round trip, so the first holder gets epoch 1.
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
	b := &pgx.Batch{}
	if len(missing) > 0 {
		b.Queue(insertMissingSQL, missing)
	}
	b.Queue(acquireSQL, names, c.owner, ttl.Seconds())

	sent := c.clock.Now()
	br := c.db.SendBatch(ctx, b)
	grant, err := c.readGrant(br, len(missing) > 0, ttl, sent)
	if cerr := br.Close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		return Grant{}, fmt.Errorf("acquire %d leases as %s: %w", len(names), c.owner, err)
	}
	for _, n := range missing {
		c.known.Store(n, struct{}{})
	}
	grant.RoundTrip = c.clock.Since(sent)
	grant.Skew = sent.Add(grant.RoundTrip / 2).Sub(grant.Now)
	if c.skew != nil && !grant.Now.IsZero() {
		c.skew.Observe(grant.Skew)
	}
	return grant, nil
}

func (c *Client) readGrant(br pgx.BatchResults, inserted bool, ttl time.Duration, sent time.Time) (Grant, error) {
	if inserted {
		if _, err := br.Exec(); err != nil {
			return Grant{}, fmt.Errorf("insert missing lease rows: %w", err)
		}
	}
	rows, err := br.Query()
	if err != nil {
		return Grant{}, err
	}
	defer rows.Close()
	var g Grant
	for rows.Next() {
		var (
			name      *string
			epoch     *int64
			expiresAt *time.Time
		)
		if err := rows.Scan(&name, &epoch, &expiresAt, &g.Now); err != nil {
			return Grant{}, err
		}
		if name == nil {
			continue // nothing granted: the row only carries compute_now()
		}
		g.Leases = append(g.Leases, Lease{
			Name: *name, Owner: c.owner, Epoch: *epoch, ExpiresAt: *expiresAt, GrantedAt: g.Now,
			TTL: ttl, ValidUntil: sent.Add(ttl),
		})
	}
	if err := rows.Err(); err != nil {
		return Grant{}, err
	}
	return g, nil
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
