package coord

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/pkg/pgdb"
)

// ErrLeaseLost is returned (wrapped in *LeaseLostError) by a fenced
// transaction whose lease is no longer held at its epoch.
var ErrLeaseLost = errors.New("lease lost")

// LeaseLostError names the lease and epoch a fence failed on.
type LeaseLostError struct {
	Name  string
	Epoch int64
}

func (e *LeaseLostError) Error() string {
	return fmt.Sprintf("lease %s is no longer held at epoch %d", e.Name, e.Epoch)
}

// Unwrap makes errors.Is(err, ErrLeaseLost) true.
func (e *LeaseLostError) Unwrap() error { return ErrLeaseLost }

const fenceSQL = `
SELECT 1 FROM leases
 WHERE name = $1 AND owner = $2 AND epoch = $3 AND expires_at > compute_now()
 FOR KEY SHARE`

// Fence locks the lease row FOR KEY SHARE at l's owner and epoch inside tx,
// or returns *LeaseLostError when it is no longer held. Call it first in
// every write transaction made on behalf of l. A bare EXISTS would not fence
// under READ COMMITTED: the lock is what orders the two holders.
//
// The lock conflicts with every UPDATE that changes a key column: epoch
// and owner are both (the unique indexes on (name, epoch) and (name,
// owner), migrations 00015 and 00023). So every write that ends a holding
// waits until tx ends: a takeover and a fresh take (new epoch), a release by
// the holder and a release on behalf of a dead member (owner NULL). A
// renewal moves expires_at alone, takes the weaker FOR NO KEY UPDATE lock
// and does not wait behind fenced work; neither does a re-take by the same
// owner after an expiry nobody used (same owner, same epoch: no holding
// ended). docs/decisions.md has why both indexes are needed.
func Fence(ctx context.Context, tx pgx.Tx, l Lease) error {
	var one int
	return fenceOutcome(l, tx.QueryRow(ctx, fenceSQL, l.Name, l.Owner, l.Epoch).Scan(&one))
}

// fenceOutcome turns the fence query's error into Fence's: no row is a lost
// lease, anything else a failed fence.
func fenceOutcome(l Lease, err error) error {
	if errors.Is(err, pgx.ErrNoRows) {
		return &LeaseLostError{Name: l.Name, Epoch: l.Epoch}
	}
	if err != nil {
		return fmt.Errorf("fence on %s@%d: %w", l.Name, l.Epoch, err)
	}
	return nil
}

// DefaultStatementTimeout bounds each statement of a fenced transaction, so a
// stuck one cannot hold a successor off for long.
const DefaultStatementTimeout = 5 * time.Second

// FenceOptions tune RunFenced.
type FenceOptions struct {
	// StatementTimeout bounds each statement (0: DefaultStatementTimeout).
	// It also bounds idle time inside the transaction.
	StatementTimeout time.Duration
	// Now is the process clock (nil: time.Now); the transaction is cancelled
	// at the lease's ValidUntil on this clock.
	Now func() time.Time
}

// RunFenced runs fn in a transaction on db that starts with Fence(l) and
// commits only if fn returns nil. The transaction gets a statement timeout
// and is cancelled when the lease's validity (l.ValidUntil) runs out, so it
// cannot outlive the process's trust in the lease; and it does not commit
// when that validity has run out by the time fn returns (see
// checkStillValid). Inside fn, nested work uses pgdb.InTx(ctx, tx, …), which
// opens a savepoint of this transaction.
func RunFenced(ctx context.Context, db pgdb.Beginner, l Lease, opts FenceOptions, fn func(ctx context.Context, tx pgx.Tx) error) error {
	timeout := opts.StatementTimeout
	if timeout <= 0 {
		timeout = DefaultStatementTimeout
	}
	if !l.ValidUntil.IsZero() {
		now := time.Now //nolint:forbidigo // the default when no clock is injected
		if opts.Now != nil {
			now = opts.Now
		}
		remaining := l.ValidUntil.Sub(now())
		if remaining <= 0 {
			return &LeaseLostError{Name: l.Name, Epoch: l.Epoch}
		}
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, remaining)
		defer cancel()
		fn = checkStillValid(l, now, fn)
	}
	ms := fmt.Sprintf("%dms", timeout.Milliseconds())
	if tb, ok := db.(txBeginner); ok {
		// The timeouts are set by BEGIN's own round trip: a process paused
		// between BEGIN and a later SET would leave a transaction open that
		// no timeout ends (and with it, later, the share lock of the fence).
		b := timedBegin{db: tb, query: "BEGIN; SET LOCAL statement_timeout = '" + ms + "'; SET LOCAL idle_in_transaction_session_timeout = '" + ms + "'"}
		return pgdb.InTx(ctx, b, func(tx pgx.Tx) error {
			if err := Fence(ctx, tx, l); err != nil {
				return err
			}
			return fn(ctx, tx)
		})
	}
	// db is a transaction: this one is a savepoint of it, and the outer
	// transaction's own timeouts are already in force for the session; set
	// this one's anyway, in the fence's round trip.
	return pgdb.InTx(ctx, db, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		b.Queue("SELECT set_config('statement_timeout', $1, true), set_config('idle_in_transaction_session_timeout', $1, true)", ms)
		b.Queue(fenceSQL, l.Name, l.Owner, l.Epoch)
		br := tx.SendBatch(ctx, b)
		if _, err := br.Exec(); err != nil {
			br.Close()
			return fmt.Errorf("fenced transaction on %s: set timeouts: %w", l.Name, err)
		}
		var one int
		err := br.QueryRow().Scan(&one)
		if cerr := br.Close(); err == nil && cerr != nil {
			err = cerr
		}
		if err := fenceOutcome(l, err); err != nil {
			return err
		}
		return fn(ctx, tx)
	})
}

// checkStillValid wraps fn so that the transaction is rolled back, with a
// *LeaseLostError, when the lease's validity has run out on the process
// clock by the time fn returns. l.ValidUntil is set.
//
// The context's deadline at ValidUntil alone does not guarantee it: a
// process stopped (SIGSTOP, a VM pause) between the fence and its writes
// wakes with that deadline passed, and its goroutine may send the writes
// and COMMIT before the timer that cancels the context has run. The lease
// row's FOR KEY SHARE lock keeps every other holder out for the whole
// transaction, but the lease has expired meanwhile, and work that relies on
// it (a gateway's node sessions) may have moved on. Checked here, after
// the writes and right before COMMIT, a pause before the check rolls back,
// and a pause after it delays only the COMMIT of writes made in time.
func checkStillValid(l Lease, now func() time.Time, fn func(ctx context.Context, tx pgx.Tx) error) func(ctx context.Context, tx pgx.Tx) error {
	return func(ctx context.Context, tx pgx.Tx) error {
		if err := fn(ctx, tx); err != nil {
			return err
		}
		if !now().Before(l.ValidUntil) {
			return &LeaseLostError{Name: l.Name, Epoch: l.Epoch}
		}
		return nil
	}
}

// txBeginner begins a transaction with options: a *pgxpool.Pool or a
// *pgx.Conn (a pgx.Tx is not one).
type txBeginner interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// timedBegin is a pgdb.Beginner whose BEGIN also sets the transaction's
// timeouts, in one simple-protocol round trip (which PgBouncer in
// transaction mode passes as one unit).
type timedBegin struct {
	db    txBeginner
	query string
}

func (b timedBegin) Begin(ctx context.Context) (pgx.Tx, error) {
	return b.db.BeginTx(ctx, pgx.TxOptions{BeginQuery: b.query})
}

// RunFenced runs fn in a transaction fenced on l, with the client's clock
// and default options.
func (c *Client) RunFenced(ctx context.Context, l Lease, fn func(ctx context.Context, tx pgx.Tx) error) error {
	return RunFenced(ctx, c.db, l, FenceOptions{Now: c.clock.Now}, fn)
}
