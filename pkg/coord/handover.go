package coord

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/pkg/pgdb"
)

// Statements for a caller that decides, inside a transaction of its own,
// who holds a lease next on behalf of other owners: the site boot
// reconciler of the worker, which renews, re-takes or promotes site:<id>:boot
// for site agents inside a transaction fenced on its shard. It ensures the
// row, locks it with LockForHandover, reads who holds it, and then calls
// Renew or Take in the same transaction.

// lockForHandoverSQL reads the row under FOR UPDATE. -infinity (released,
// or never held) reads as 1970: long expired.
const lockForHandoverSQL = `
SELECT owner, epoch, GREATEST(expires_at, 'epoch'::timestamptz), compute_now() FROM leases WHERE name = $1 FOR UPDATE`

// Holding is a lease row as LockForHandover read it.
type Holding struct {
	Name string
	// Owner is "" when nobody holds the lease (released, or never held).
	Owner string
	Epoch int64
	// ExpiresAt is on the database clock; a lease released or never held
	// reads as 1970-01-01, long expired.
	ExpiresAt time.Time
	// Now is compute_now() of the locking statement.
	Now time.Time
}

// Live reports whether the lease has an owner and has not expired at Now.
func (h Holding) Live() bool { return h.Owner != "" && h.ExpiresAt.After(h.Now) }

// Ensure creates the row of lease name (no owner, epoch 0, expired) when
// it is missing, and leaves an existing row alone. Take and AcquireMany
// create their rows themselves; a caller of LockForHandover calls it first.
func Ensure(ctx context.Context, q pgdb.Querier, name string) error {
	if err := ValidateName(name); err != nil {
		return err
	}
	if _, err := q.Exec(ctx, ensureRowSQL, name); err != nil {
		return fmt.Errorf("create lease row %s: %w", name, err)
	}
	return nil
}

// LockForHandover locks the row of lease name FOR UPDATE in tx and returns
// it; the row must exist (Ensure). Call it before deciding, in tx, whether
// to Renew the lease for its holder or Take it for another owner.
//
// FOR UPDATE conflicts with every other row lock, the fence's FOR KEY
// SHARE included: it waits until every open transaction fenced on the
// lease (Fence, RunFenced, FenceSiteBootSQL) has ended, and until tx ends
// no other transaction can fence on the lease, renew it, take it or
// release it. So a Renew or Take in tx that acts on what this read cannot
// lose a race, and no fenced write at the old holding is still open when
// the lease changes hands.
func LockForHandover(ctx context.Context, tx pgx.Tx, name string) (Holding, error) {
	h := Holding{Name: name}
	var owner *string
	if err := tx.QueryRow(ctx, lockForHandoverSQL, name).Scan(&owner, &h.Epoch, &h.ExpiresAt, &h.Now); err != nil {
		return Holding{}, fmt.Errorf("lock lease %s: %w", name, err)
	}
	if owner != nil {
		h.Owner = *owner
	}
	return h, nil
}
