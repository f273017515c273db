package queue

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgdb"
)

// Querier runs statements: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
type Querier = pgdb.Querier

// ErrClaimLost is returned (wrapped) by Complete and Fail when the item's
// claim is no longer the one on the row: it expired and was claimed again,
// or it was released. The row is left untouched; whoever holds the claim now
// owns the key. Inside a fenced transaction the caller should roll back.
var ErrClaimLost = errors.New("work queue claim lost")

// MaxErrorLen bounds the last_error recorded by Fail, in bytes.
const MaxErrorLen = 2000

// Item is one claimed key (from Claim) or a row's state after an enqueue.
type Item struct {
	Reconciler string
	Key        string
	// Shard is coord.ShardOf(Key).
	Shard int
	// Generation rises on every enqueue; Complete deletes the key only at
	// the generation it claimed.
	Generation int64
	// Attempts counts runs started since the last success (Claim adds one,
	// a successful Complete resets it, Fail keeps it for the back-off).
	Attempts int
	// DueAt is when the key became due (for a claim: the due time it was
	// claimed at; for a claim taken over after expiry, the old claim's end).
	DueAt time.Time
	// Owner holds the claim until ClaimedUntil; empty when unclaimed.
	Owner        string
	ClaimedUntil time.Time
	// LastError is the error recorded by the last Fail, or "".
	LastError string
	// EnqueuedAt is when the wake-up this row waits to serve was enqueued.
	EnqueuedAt time.Time
}

const itemColumns = `reconciler, key, shard, generation, attempts, due_at, claimed_by, claimed_until, last_error, enqueued_at`

func scanItem(row pgx.Row) (Item, error) {
	var (
		it        Item
		shard     int16
		owner     *string
		until     *time.Time
		lastError *string
	)
	if err := row.Scan(&it.Reconciler, &it.Key, &shard, &it.Generation, &it.Attempts, &it.DueAt, &owner, &until, &lastError, &it.EnqueuedAt); err != nil {
		return Item{}, err
	}
	it.Shard = int(shard)
	if owner != nil {
		it.Owner = *owner
	}
	if until != nil {
		it.ClaimedUntil = *until
	}
	if lastError != nil {
		it.LastError = *lastError
	}
	return it, nil
}

// enqueueSQL inserts a key or, when it is queued already, bumps its
// generation and pulls due_at earlier, never later. A claimed row's due_at is
// 'infinity' (see Claim), so the first enqueue during a run sets the due time
// of the next run and later ones can only pull it earlier; that first enqueue
// also restarts enqueued_at. Attempts are kept: they count failed runs for
// the back-off, and only a successful run resets them.
const enqueueSQL = `
INSERT INTO work_queue AS w (reconciler, key, shard, due_at)
SELECT $1, k, s, compute_now() + make_interval(secs => $4::float8)
  FROM unnest($2::text[], $3::smallint[]) AS u(k, s)
ON CONFLICT (reconciler, key) DO UPDATE SET
  generation  = w.generation + 1,
  enqueued_at = CASE WHEN w.due_at = 'infinity' THEN compute_now() ELSE w.enqueued_at END,
  due_at      = LEAST(w.due_at, EXCLUDED.due_at)
RETURNING ` + itemColumns

// Enqueue asks for key to be reconciled by reconciler after delay (0: as soon
// as possible) and returns the row as it now stands. A key already queued
// gets a new generation and the earlier of its due times; a key being run
// will run again after the run completes. The key's shard is
// coord.ShardOf(key). db may be a transaction: the enqueue then happens
// exactly when the caller's change commits.
func Enqueue(ctx context.Context, db Querier, reconciler, key string, delay time.Duration) (Item, error) {
	if err := ValidateReconciler(reconciler); err != nil {
		return Item{}, err
	}
	if err := ValidateKey(key); err != nil {
		return Item{}, err
	}
	if err := validateDelay(delay); err != nil {
		return Item{}, err
	}
	row := db.QueryRow(ctx, enqueueSQL, reconciler, []string{key}, []int16{int16(coord.ShardOf(key))}, delay.Seconds())
	it, err := scanItem(row)
	if err != nil {
		return Item{}, fmt.Errorf("enqueue %s/%s: %w", reconciler, key, err)
	}
	return it, nil
}

// EnqueueMany is Enqueue of many keys in one statement. Duplicate keys count
// once. Keys are written in sorted order, so concurrent batches lock rows in
// the same order and do not deadlock each other. It returns the number of
// distinct keys enqueued.
func EnqueueMany(ctx context.Context, db Querier, reconciler string, keys []string, delay time.Duration) (int, error) {
	if err := ValidateReconciler(reconciler); err != nil {
		return 0, err
	}
	for _, k := range keys {
		if err := ValidateKey(k); err != nil {
			return 0, err
		}
	}
	if err := validateDelay(delay); err != nil {
		return 0, err
	}
	if len(keys) == 0 {
		return 0, nil
	}
	sorted := slices.Clone(keys)
	slices.Sort(sorted)
	sorted = slices.Compact(sorted) // ON CONFLICT cannot touch one row twice in a statement
	shards := make([]int16, len(sorted))
	for i, k := range sorted {
		shards[i] = int16(coord.ShardOf(k))
	}
	tag, err := db.Exec(ctx, enqueueSQL, reconciler, sorted, shards, delay.Seconds())
	if err != nil {
		return 0, fmt.Errorf("enqueue %d keys of %s: %w", len(sorted), reconciler, err)
	}
	return int(tag.RowsAffected()), nil
}

// claimSQL claims up to $3 keys of reconciler $1 in shards $2, earliest due
// first. A key is claimable when it is unclaimed and due, or when its claim
// has expired (its worker died or stalled past the claim TTL). LEAST ignores
// NULL, so LEAST(due_at, claimed_until) is due_at for an unclaimed key and
// the claim's end for an expired one (its due_at is 'infinity' unless it was
// enqueued during the dead run). SKIP LOCKED makes concurrent claimers take
// disjoint keys; a row claimed and committed meanwhile is rechecked by
// READ COMMITTED's re-evaluation and dropped. The claim sets due_at to
// 'infinity': a claimed key is not due again until an enqueue says so.
// LEAST(due_at, claimed_until) must match the expression of
// work_queue_claim_idx (migration 00005), which serves the ORDER BY.
const claimSQL = `
WITH picked AS (
  SELECT reconciler, key, LEAST(due_at, claimed_until) AS was_due
    FROM work_queue
   WHERE reconciler = $1 AND shard = ANY($2::smallint[])
     AND LEAST(due_at, claimed_until) <= compute_now()
     AND (claimed_until IS NULL OR claimed_until < compute_now())
   ORDER BY LEAST(due_at, claimed_until)
   LIMIT $3
   FOR UPDATE SKIP LOCKED
)
UPDATE work_queue w SET
  claimed_by    = $4,
  claimed_until = compute_now() + make_interval(secs => $5::float8),
  attempts      = w.attempts + 1,
  due_at        = 'infinity'
  FROM picked p
 WHERE w.reconciler = p.reconciler AND w.key = p.key
RETURNING w.reconciler, w.key, w.shard, w.generation, w.attempts, p.was_due, w.claimed_by, w.claimed_until, w.last_error, w.enqueued_at`

// Claim claims up to limit due keys of reconciler in shards for owner, until
// compute_now() + claimTTL, in one statement, and returns them earliest due
// first. Call it only for shards whose leases owner holds, and run each item
// in a transaction fenced on its shard's lease. No shards: nothing claimed.
func Claim(ctx context.Context, db Querier, reconciler, owner string, shards []int, limit int, claimTTL time.Duration) ([]Item, error) {
	if err := ValidateReconciler(reconciler); err != nil {
		return nil, err
	}
	if err := ValidateOwner(owner); err != nil {
		return nil, err
	}
	if err := validateShards(shards); err != nil {
		return nil, err
	}
	if err := validateLimit(limit); err != nil {
		return nil, err
	}
	if err := validateClaimTTL(claimTTL); err != nil {
		return nil, err
	}
	if len(shards) == 0 {
		return nil, nil
	}
	s16 := make([]int16, len(shards))
	for i, s := range shards {
		s16[i] = int16(s)
	}
	rows, err := db.Query(ctx, claimSQL, reconciler, s16, limit, owner, claimTTL.Seconds())
	if err != nil {
		return nil, fmt.Errorf("claim %s as %s: %w", reconciler, owner, err)
	}
	items, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Item, error) { return scanItem(r) })
	if err != nil {
		return nil, fmt.Errorf("claim %s as %s: %w", reconciler, owner, err)
	}
	slices.SortFunc(items, func(a, b Item) int {
		if c := a.DueAt.Compare(b.DueAt); c != 0 {
			return c
		}
		return strings.Compare(a.Key, b.Key)
	})
	return items, nil
}

// Completion is what Complete did to a key.
type Completion int

const (
	// Deleted: no enqueue happened during the run; the key is done.
	Deleted Completion = iota + 1
	// Rearmed: the key was enqueued during the run (a newer generation); its
	// claim is cleared so it runs again, at the due time that enqueue asked for.
	Rearmed
)

func (c Completion) String() string {
	switch c {
	case Deleted:
		return "deleted"
	case Rearmed:
		return "rearmed"
	}
	return fmt.Sprintf("Completion(%d)", int(c))
}

// The claim is identified by owner and claimed_until: an expired claim taken
// again, even by the same owner, has another claimed_until.
const completeDeleteSQL = `
DELETE FROM work_queue
 WHERE reconciler = $1 AND key = $2 AND generation = $3 AND claimed_by = $4 AND claimed_until = $5`

const completeRearmSQL = `
UPDATE work_queue SET
  claimed_by = NULL, claimed_until = NULL, attempts = 0, last_error = NULL,
  due_at = CASE WHEN due_at = 'infinity' THEN compute_now() ELSE due_at END
 WHERE reconciler = $1 AND key = $2 AND claimed_by = $3 AND claimed_until = $4`

// Complete ends a successful run of item. It deletes the key only at the
// generation it claimed; if the key was enqueued during the run, it keeps
// the key and clears the claim so the new generation runs (Rearmed), so no
// wake-up is lost. Call it inside the run's transaction fenced on the
// shard's lease, so the deletion commits together with the run's writes, or
// not at all when the lease was lost.
//
// The delete is one statement: under READ COMMITTED a concurrent enqueue
// that commits first makes its generation check fail on the new row version;
// one that comes after waits for this transaction and then inserts afresh.
// When the claim is no longer item's, nothing changes and the error wraps
// ErrClaimLost.
func Complete(ctx context.Context, db Querier, item Item) (Completion, error) {
	if err := validateItem(item); err != nil {
		return 0, err
	}
	tag, err := db.Exec(ctx, completeDeleteSQL, item.Reconciler, item.Key, item.Generation, item.Owner, item.ClaimedUntil)
	if err != nil {
		return 0, fmt.Errorf("complete %s/%s@%d: %w", item.Reconciler, item.Key, item.Generation, err)
	}
	if tag.RowsAffected() == 1 {
		return Deleted, nil
	}
	tag, err = db.Exec(ctx, completeRearmSQL, item.Reconciler, item.Key, item.Owner, item.ClaimedUntil)
	if err != nil {
		return 0, fmt.Errorf("complete %s/%s@%d: re-arm: %w", item.Reconciler, item.Key, item.Generation, err)
	}
	if tag.RowsAffected() == 1 {
		return Rearmed, nil
	}
	return 0, fmt.Errorf("complete %s/%s@%d as %s: %w", item.Reconciler, item.Key, item.Generation, item.Owner, ErrClaimLost)
}

const failSQL = `
UPDATE work_queue SET
  claimed_by = NULL, claimed_until = NULL, last_error = $5,
  due_at = compute_now() + make_interval(secs => $6::float8)
 WHERE reconciler = $1 AND key = $2 AND claimed_by = $3 AND claimed_until = $4
RETURNING due_at`

// Fail ends a failed run of item: it records runErr as last_error (valid
// UTF-8, at most MaxErrorLen bytes), clears the claim and makes the key due
// again after backoff.Delay(item.Attempts). The key stays at its generation
// (an enqueue during the failed run is served by the retry). Call it outside
// the failed run's transaction, which has rolled back. It returns the new
// due time (compute_now() clock). Until then an enqueue may pull the key
// earlier; attempts are kept, so the next failure backs off further.
func Fail(ctx context.Context, db Querier, item Item, runErr error, backoff Backoff) (time.Time, error) {
	if err := validateItem(item); err != nil {
		return time.Time{}, err
	}
	if err := backoff.Validate(); err != nil {
		return time.Time{}, invalid("backoff", fmt.Sprintf("%s..%s", backoff.Base, backoff.Max), err.Error())
	}
	msg := "run failed without an error"
	if runErr != nil {
		msg = runErr.Error()
	}
	delay := backoff.Delay(item.Attempts)
	var due time.Time
	err := db.QueryRow(ctx, failSQL, item.Reconciler, item.Key, item.Owner, item.ClaimedUntil, truncateError(msg), delay.Seconds()).Scan(&due)
	if errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, fmt.Errorf("fail %s/%s as %s: %w", item.Reconciler, item.Key, item.Owner, ErrClaimLost)
	}
	if err != nil {
		return time.Time{}, fmt.Errorf("fail %s/%s as %s: %w", item.Reconciler, item.Key, item.Owner, err)
	}
	return due, nil
}

// truncateError makes msg storable as text: valid UTF-8, no NUL, at most
// MaxErrorLen bytes, cut on a rune boundary with a marker.
func truncateError(msg string) string {
	msg = strings.ToValidUTF8(msg, "\uFFFD")
	msg = strings.ReplaceAll(msg, "\x00", "\uFFFD")
	if len(msg) <= MaxErrorLen {
		return msg
	}
	const marker = "…(truncated)"
	cut := MaxErrorLen - len(marker)
	for cut > 0 && !utf8.RuneStart(msg[cut]) {
		cut--
	}
	return msg[:cut] + marker
}

const releaseSQL = `
UPDATE work_queue SET
  claimed_by = NULL, claimed_until = NULL,
  attempts = GREATEST(attempts - 1, 0),
  due_at = LEAST(due_at, compute_now())
 WHERE claimed_by = $1`

// ReleaseClaims gives up every claim owner holds (on shutdown, after its
// runs have stopped), so the next holder of each shard runs the keys at once
// instead of after the claim TTL. A released claim is not a failed attempt:
// its attempt is taken back. It returns the number of keys released.
func ReleaseClaims(ctx context.Context, db Querier, owner string) (int, error) {
	if err := ValidateOwner(owner); err != nil {
		return 0, err
	}
	tag, err := db.Exec(ctx, releaseSQL, owner)
	if err != nil {
		return 0, fmt.Errorf("release work queue claims of %s: %w", owner, err)
	}
	return int(tag.RowsAffected()), nil
}

const releaseOneSQL = releaseSQL + ` AND reconciler = $2 AND key = $3 AND claimed_until = $4`

// ReleaseClaim gives up one claim (a key whose shard moved after the claim),
// taking its attempt back. It returns whether the claim was still this one.
func ReleaseClaim(ctx context.Context, db Querier, item Item) (bool, error) {
	tag, err := db.Exec(ctx, releaseOneSQL, item.Owner, item.Reconciler, item.Key, item.ClaimedUntil)
	if err != nil {
		return false, fmt.Errorf("release claim on %s/%s: %w", item.Reconciler, item.Key, err)
	}
	return tag.RowsAffected() == 1, nil
}
