package coord

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/pkg/pgdb"
)

// Single-lease statements for callers that take a lease on behalf of an owner
// inside their own transaction (the site boot reconciler, which holds
// site:<id>:boot for an agent inside a transaction fenced on its shard) and
// for Keeper. They follow the epoch rule of epoch.go.

var takeSQL = `
UPDATE leases SET owner = $2,
  epoch = ` + nextEpochSQL("$2", "0") + `,
  acquired_at = ` + acquiredAtSQL("$2", "0") + `,
  expires_at = compute_now() + make_interval(secs => $3::float8)
 WHERE name = $1 AND (owner = $2 OR expires_at < compute_now())
RETURNING epoch, expires_at, compute_now(), lease_epoch_floor()`

var takeFreshSQL = `
UPDATE leases SET owner = $2,
  epoch = ` + freshEpochSQL("0") + `,
  acquired_at = compute_now(),
  expires_at = compute_now() + make_interval(secs => $3::float8)
 WHERE name = $1 AND (owner = $2 OR expires_at < compute_now())
RETURNING epoch, expires_at, compute_now(), lease_epoch_floor()`

// renewSQL extends a lease only for its owner at its epoch. It does not ask
// for the lease to be unexpired: an expired lease still at the same owner
// and epoch was held by nobody else meanwhile.
const renewSQL = `
UPDATE leases SET expires_at = compute_now() + make_interval(secs => $4::float8)
 WHERE name = $1 AND owner = $2 AND epoch = $3
RETURNING expires_at, compute_now(), lease_epoch_floor()`

const ensureRowSQL = `INSERT INTO leases (name) VALUES ($1) ON CONFLICT (name) DO NOTHING`

// Take grants name to owner for ttl in q when owner already holds it or it
// has expired; the epoch rises only on a change of owner. ok is false (and
// err nil) when another owner holds it live. The row is created if missing.
// The returned lease has GrantedAt and ExpiresAt on the database clock and
// no ValidUntil: the caller decides how long the holder trusts it.
func Take(ctx context.Context, q pgdb.Querier, name, owner string, ttl time.Duration) (Lease, bool, error) {
	return take(ctx, q, takeSQL, name, owner, ttl)
}

// TakeFresh is Take, except that the epoch always rises, also when owner
// already holds the lease: a holder that stopped trusting its lease (it
// fenced itself) starts a new holding, and any write still in flight at the
// old epoch fails its fence.
func TakeFresh(ctx context.Context, q pgdb.Querier, name, owner string, ttl time.Duration) (Lease, bool, error) {
	return take(ctx, q, takeFreshSQL, name, owner, ttl)
}

func take(ctx context.Context, q pgdb.Querier, sql, name, owner string, ttl time.Duration) (Lease, bool, error) {
	if err := ValidateName(name); err != nil {
		return Lease{}, false, err
	}
	if err := ValidateOwner(owner); err != nil {
		return Lease{}, false, err
	}
	if err := ValidateTTL(ttl); err != nil {
		return Lease{}, false, err
	}
	if _, err := q.Exec(ctx, ensureRowSQL, name); err != nil {
		return Lease{}, false, fmt.Errorf("create lease row %s: %w", name, err)
	}
	l := Lease{Name: name, Owner: owner, TTL: ttl}
	err := q.QueryRow(ctx, sql, name, owner, ttl.Seconds()).Scan(&l.Epoch, &l.ExpiresAt, &l.GrantedAt, &l.Floor)
	if errors.Is(err, pgx.ErrNoRows) {
		return Lease{}, false, nil
	}
	if err != nil {
		return Lease{}, false, fmt.Errorf("take %s for %s: %w", name, owner, err)
	}
	return l, true, nil
}

// Renew extends l for ttl in q only while l.Owner still holds it at
// l.Epoch; ok is false when the lease changed hands. The returned lease has
// the new ExpiresAt and GrantedAt.
func Renew(ctx context.Context, q pgdb.Querier, l Lease, ttl time.Duration) (Lease, bool, error) {
	if err := ValidateTTL(ttl); err != nil {
		return Lease{}, false, err
	}
	err := q.QueryRow(ctx, renewSQL, l.Name, l.Owner, l.Epoch, ttl.Seconds()).Scan(&l.ExpiresAt, &l.GrantedAt, &l.Floor)
	if errors.Is(err, pgx.ErrNoRows) {
		return Lease{}, false, nil
	}
	if err != nil {
		return Lease{}, false, fmt.Errorf("renew %s@%d for %s: %w", l.Name, l.Epoch, l.Owner, err)
	}
	l.TTL = ttl
	return l, true, nil
}
