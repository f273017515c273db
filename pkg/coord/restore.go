package coord

// A database that went back in time (docs/database-failover.md, "A database
// restored from an earlier backup"; migration 00030).
//
// An operator who restores an earlier backup (pg_dump, a volume snapshot)
// under running processes brings back lease rows at the epochs of the
// backup. The epoch rule alone (epoch.go) would then hand out again every
// epoch issued between the backup and the restore. What tells: the running
// processes remember more than the database has. Every Client remembers
//
//   - the highest mark (lease_epoch_floor(), lease_grant_count()) its grant
//     statements returned, compared as a pair: a promotion or a detected
//     restore raises the floor, and between those the count of changes of
//     owner only rises; and
//   - per lease, the highest epoch it was granted.
//
// Every grant statement (AcquireMany, and the Keeper's take) sends both and
// grants nothing when the database shows a lower mark, or a row of one of
// its names below the epoch this client held it at within the current
// floor. The client then records the regression (epoch_regressions, for
// leasehold-doctor's db.restored) and raises leasehold_instance.generation,
// which lifts lease_epoch_floor() by 2^48: every epoch any process takes from
// then on is above every epoch of the earlier generation, including those
// only a dead process or a node remembers. Then it sends the statement
// again. A row found behind is never kept at its old epoch by the process
// that remembers more: its next grant is a new holding (epoch.go).

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// ErrDatabaseBehind is returned when a grant statement still found the
// database behind what this client saw after recording the regression (a
// concurrent restore, or the record itself failing to raise the floor).
var ErrDatabaseBehind = errors.New("the database is behind what this process saw")

// generationShift places the restore generation above the timeline bits of
// lease_epoch_floor().
const generationShift = 48

// Generation is the restore generation encoded in an epoch floor.
func Generation(floor int64) int64 { return floor >> generationShift }

// mark is a point of the database's history as a client saw it.
type mark struct {
	floor  int64 // lease_epoch_floor()
	grants int64 // lease_grant_count()
}

// before reports m strictly before o: a lower floor, or the same floor and
// fewer grants.
func (m mark) before(o mark) bool {
	return m.floor < o.floor || (m.floor == o.floor && m.grants < o.grants)
}

// epochMemory is what a client remembers of the database's history. It is
// safe for concurrent use.
type epochMemory struct {
	mu     sync.Mutex
	high   mark
	epochs map[string]int64 // lease name -> highest epoch granted
}

// seen returns the remembered mark and, aligned with names, the highest
// epoch granted for each (0: never).
func (m *epochMemory) seen(names []string) (mark, []int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]int64, len(names))
	for i, n := range names {
		out[i] = m.epochs[n]
	}
	return m.high, out
}

// observe raises the remembered mark to at, never lowers it.
func (m *epochMemory) observe(at mark) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.high.before(at) {
		m.high = at
	}
}

// granted remembers that name was granted at epoch.
func (m *epochMemory) granted(name string, epoch int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.epochs == nil {
		m.epochs = map[string]int64{}
	}
	if epoch > m.epochs[name] {
		m.epochs[name] = epoch
	}
}

// LeaseBehind is one lease row found below the epoch a process held it at.
type LeaseBehind struct {
	Name  string
	Seen  int64 // the epoch this process was granted
	Found int64 // the row's epoch in the database
}

// Regression describes a database found behind what a process saw.
type Regression struct {
	// DetectedBy is the owner whose grant statement found it.
	DetectedBy string
	// SeenFloor and SeenGrants are the mark the process remembered;
	// FoundFloor and FoundGrants what the database showed.
	SeenFloor, FoundFloor   int64
	SeenGrants, FoundGrants int64
	// Leases are the rows found behind (may be empty: only the mark was).
	Leases []LeaseBehind
	// RaisedTo is the generation this detection raised the database to; 0
	// when a concurrent detection had already raised it.
	RaisedTo int64
}

// String is one line for logs.
func (r Regression) String() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "the database went back in time: %s saw epoch floor %d with %d grants, the database had floor %d with %d grants",
		r.DetectedBy, r.SeenFloor, r.SeenGrants, r.FoundFloor, r.FoundGrants)
	for _, l := range r.Leases {
		fmt.Fprintf(&sb, "; %s was granted at epoch %d, the database had it at %d", l.Name, l.Seen, l.Found)
	}
	if r.RaisedTo > 0 {
		fmt.Fprintf(&sb, "; generation raised to %d", r.RaisedTo)
	}
	return sb.String()
}

// WithLogger sets the logger of the client's rare events (a database that
// went back in time). Without it the client logs with the logger of the
// first Keeper or Renewer built on it, else slog.Default().
func WithLogger(l *slog.Logger) ClientOption {
	return func(cl *Client) {
		if l != nil {
			cl.log = l
		}
	}
}

func (c *Client) logger() *slog.Logger {
	if c.log != nil {
		return c.log
	}
	return slog.Default()
}

// adoptLogger makes l the client's logger unless it has one.
func (c *Client) adoptLogger(l *slog.Logger) {
	if c.log == nil {
		c.log = l
	}
}

// WithRegressionObserver calls fn (on the granting goroutine) each time this
// client detects and records a database that went back in time.
func WithRegressionObserver(fn func(Regression)) ClientOption {
	return func(cl *Client) { cl.onRegression = fn }
}

// guardedGrantSQL is the grant statement of AcquireMany (fresh false: the
// epoch rule of epoch.go) and of Keeper (fresh true: always a new holding).
//
//	$1 names, $2 owner, $3 TTL seconds, $4 the epochs this client last held
//	each name at (aligned with $1), $5 and $6 the mark it remembers.
//
// It returns one row per granted name, or one row with NULL name, epoch and
// expiry when nothing was granted; every row carries compute_now(), the
// mark, whether the database was intact, and the rows found behind.
func guardedGrantSQL(fresh bool) string {
	epoch := nextEpochSQL("$2", "u.seen_epoch")
	acquired := acquiredAtSQL("$2", "u.seen_epoch")
	if fresh {
		epoch = freshEpochSQL("u.seen_epoch")
		acquired = "compute_now()"
	}
	return `
WITH u AS (
  SELECT lease_name, seen_epoch FROM unnest($1::text[], $4::bigint[]) AS s(lease_name, seen_epoch)
), st AS (
  SELECT compute_now() AS now, lease_epoch_floor() AS floor, lease_grant_count() AS grants
), behind AS (
  SELECT l.name, l.epoch AS found, u.seen_epoch AS seen
    FROM leases l JOIN u ON u.lease_name = l.name CROSS JOIN st
   WHERE l.epoch < u.seen_epoch AND u.seen_epoch >= st.floor
), guard AS (
  SELECT NOT EXISTS (SELECT 1 FROM behind) AND (st.floor, st.grants) >= ($5::bigint, $6::bigint) AS intact FROM st
), granted AS (
  UPDATE leases SET owner = $2,
    epoch = ` + epoch + `,
    acquired_at = ` + acquired + `,
    expires_at = compute_now() + make_interval(secs => $3::float8)
    FROM u, guard
   WHERE name = u.lease_name AND guard.intact AND (owner = $2 OR expires_at < compute_now())
  RETURNING name, epoch, expires_at
)
SELECT g.name, g.epoch, g.expires_at, st.now, st.floor, st.grants, guard.intact,
       (SELECT array_agg(b.name ORDER BY b.name) FROM behind b),
       (SELECT array_agg(b.seen ORDER BY b.name) FROM behind b),
       (SELECT array_agg(b.found ORDER BY b.name) FROM behind b)
  FROM st CROSS JOIN guard LEFT JOIN granted g ON true`
}

var (
	acquireSQL = guardedGrantSQL(false)
	keepSQL    = guardedGrantSQL(true)
)

// recordRegressionSQL raises the generation unless a concurrent detection
// already did (the generation is above what this client saw) and records
// the detection, one row per lease found behind or one row without a lease.
//
//	$1 owner, $2 the generation this client saw, $3..$6 seen and found
//	floor and grants, $7..$9 the rows behind (name, seen, found).
const recordRegressionSQL = `
WITH raised AS (
  INSERT INTO leasehold_instance AS i (singleton, generation, generation_at) VALUES (true, $2::bigint + 1, compute_now())
  ON CONFLICT (singleton) DO UPDATE SET generation = GREATEST(i.generation, $2::bigint) + 1, generation_at = compute_now()
   WHERE i.generation <= $2::bigint
  RETURNING generation
), rows AS (
  SELECT * FROM unnest($7::text[], $8::bigint[], $9::bigint[]) AS b(name, seen, found)
  UNION ALL SELECT NULL, NULL, NULL WHERE cardinality($7::text[]) = 0
)
INSERT INTO epoch_regressions (detected_by, lease_name, seen_epoch, found_epoch,
                               seen_floor, found_floor, seen_grants, found_grants, raised_generation)
SELECT $1, r.name, r.seen, r.found, $3, $4, $5, $6, (SELECT generation FROM raised)
  FROM rows r
RETURNING coalesce(raised_generation, 0)`

// maxRegressionRecords bounds how often one grant records a regression and
// tries again.
const maxRegressionRecords = 2

// grantResult is one run of the guarded grant statement.
type grantResult struct {
	grant  Grant
	at     mark
	intact bool
	behind []LeaseBehind
}

// grantGuarded runs the guarded grant statement for names, first inserting
// the rows of ensure. When the database is behind what this client saw it
// records the regression, raising the epoch floor, and runs it again.
func (c *Client) grantGuarded(ctx context.Context, sql string, names, ensure []string, ttl time.Duration) (Grant, time.Time, error) {
	for attempt := 0; ; attempt++ {
		seenMark, seenEpochs := c.mem.seen(names)
		sent := c.clock.Now()
		r, err := c.runGrant(ctx, sql, names, ensure, ttl, seenMark, seenEpochs, sent)
		if err != nil {
			return Grant{}, sent, err
		}
		c.mem.observe(r.at)
		if r.intact {
			for _, l := range r.grant.Leases {
				c.mem.granted(l.Name, l.Epoch)
			}
			return r.grant, sent, nil
		}
		reg := Regression{DetectedBy: c.owner, SeenFloor: seenMark.floor, SeenGrants: seenMark.grants,
			FoundFloor: r.at.floor, FoundGrants: r.at.grants, Leases: r.behind}
		if attempt == maxRegressionRecords {
			return Grant{}, sent, fmt.Errorf("%w: %s", ErrDatabaseBehind, reg)
		}
		if reg.RaisedTo, err = c.recordRegression(ctx, reg); err != nil {
			return Grant{}, sent, err
		}
		// Rows created after the backup are gone: insert them again.
		c.known.Clear()
		ensure = names
		c.logger().Error("the database went back in time; recorded it and raised the epoch floor, see docs/database-failover.md",
			"owner", c.owner, "regression", reg.String())
		if c.onRegression != nil {
			c.onRegression(reg)
		}
	}
}

func (c *Client) runGrant(ctx context.Context, sql string, names, ensure []string, ttl time.Duration, seen mark, seenEpochs []int64, sent time.Time) (grantResult, error) {
	b := &pgx.Batch{}
	if len(ensure) > 0 {
		b.Queue(insertMissingSQL, ensure)
	}
	b.Queue(sql, names, c.owner, ttl.Seconds(), seenEpochs, seen.floor, seen.grants)
	br := c.db.SendBatch(ctx, b)
	r, err := c.readGuarded(br, len(ensure) > 0, ttl, sent)
	if cerr := br.Close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		return grantResult{}, err
	}
	for _, n := range ensure {
		c.known.Store(n, struct{}{})
	}
	return r, nil
}

func (c *Client) readGuarded(br pgx.BatchResults, inserted bool, ttl time.Duration, sent time.Time) (grantResult, error) {
	if inserted {
		if _, err := br.Exec(); err != nil {
			return grantResult{}, fmt.Errorf("insert missing lease rows: %w", err)
		}
	}
	rows, err := br.Query()
	if err != nil {
		return grantResult{}, err
	}
	defer rows.Close()
	var r grantResult
	for rows.Next() {
		var (
			name        *string
			epoch       *int64
			expiresAt   *time.Time
			behindNames []string
			behindSeen  []int64
			behindFound []int64
		)
		if err := rows.Scan(&name, &epoch, &expiresAt, &r.grant.Now, &r.at.floor, &r.at.grants, &r.intact,
			&behindNames, &behindSeen, &behindFound); err != nil {
			return grantResult{}, err
		}
		if r.behind == nil {
			for i, n := range behindNames {
				r.behind = append(r.behind, LeaseBehind{Name: n, Seen: behindSeen[i], Found: behindFound[i]})
			}
		}
		if name == nil {
			continue // nothing granted: the row only carries the state
		}
		r.grant.Leases = append(r.grant.Leases, Lease{
			Name: *name, Owner: c.owner, Epoch: *epoch, ExpiresAt: *expiresAt, GrantedAt: r.grant.Now,
			Floor: r.at.floor, TTL: ttl, ValidUntil: sent.Add(ttl),
		})
	}
	if err := rows.Err(); err != nil {
		return grantResult{}, err
	}
	return r, nil
}

// recordRegression records reg and raises the generation (once for
// concurrent detections of one regression). It returns the generation it
// raised the database to, 0 when another detection already had.
func (c *Client) recordRegression(ctx context.Context, reg Regression) (int64, error) {
	names := make([]string, len(reg.Leases))
	seen := make([]int64, len(reg.Leases))
	found := make([]int64, len(reg.Leases))
	for i, l := range reg.Leases {
		names[i], seen[i], found[i] = l.Name, l.Seen, l.Found
	}
	rows, err := c.db.Query(ctx, recordRegressionSQL, c.owner, Generation(reg.SeenFloor),
		reg.SeenFloor, reg.FoundFloor, reg.SeenGrants, reg.FoundGrants, names, seen, found)
	if err != nil {
		return 0, fmt.Errorf("record %s: %w", reg, err)
	}
	raised, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return 0, fmt.Errorf("record %s: %w", reg, err)
	}
	if len(raised) == 0 {
		return 0, nil
	}
	return raised[0], nil
}

// takeKept is the Keeper's take: a new holding of name (TakeFresh's rule)
// through the guarded grant statement.
func (c *Client) takeKept(ctx context.Context, name string, ttl time.Duration) (Lease, bool, error) {
	if err := ValidateName(name); err != nil {
		return Lease{}, false, err
	}
	if err := ValidateTTL(ttl); err != nil {
		return Lease{}, false, err
	}
	names := []string{name}
	g, _, err := c.grantGuarded(ctx, keepSQL, names, names, ttl)
	if err != nil {
		return Lease{}, false, fmt.Errorf("take %s for %s: %w", name, c.owner, err)
	}
	l, ok := g.Get(name)
	l.ValidUntil = time.Time{}
	return l, ok, nil
}
