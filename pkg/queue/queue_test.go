package queue_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/queue"
)

const rec = "node"

var allShards = func() []int {
	s := make([]int, coord.NumShards)
	for i := range s {
		s[i] = i
	}
	return s
}()

type bundle struct {
	ctx context.Context
	db  *pgxpool.Pool
}

func setup(t *testing.T) bundle {
	t.Helper()
	return bundle{ctx: context.Background(), db: pgtest.New(t)}
}

// row is a work_queue row read back directly.
type row struct {
	Generation int64
	Attempts   int
	DueIn      time.Duration // due_at - compute_now(); -1ns marks 'infinity'
	Owner      *string
	LastError  *string
}

func (s bundle) row(t *testing.T, key string) (row, bool) {
	t.Helper()
	var r row
	var dueIn *float64
	err := s.db.QueryRow(s.ctx, `
SELECT generation, attempts,
       CASE WHEN due_at = 'infinity' THEN NULL ELSE EXTRACT(EPOCH FROM due_at - compute_now())::float8 END,
       claimed_by, last_error
  FROM work_queue WHERE reconciler = $1 AND key = $2`, rec, key).Scan(&r.Generation, &r.Attempts, &dueIn, &r.Owner, &r.LastError)
	if errors.Is(err, pgx.ErrNoRows) {
		return row{}, false
	}
	require.NoError(t, err)
	r.DueIn = -1
	if dueIn != nil {
		r.DueIn = time.Duration(*dueIn * float64(time.Second))
	}
	return r, true
}

func (s bundle) count(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, s.db.QueryRow(s.ctx, "SELECT count(*) FROM work_queue").Scan(&n))
	return n
}

func (s bundle) now(t *testing.T) time.Time {
	t.Helper()
	now, err := pgdb.Now(s.ctx, s.db)
	require.NoError(t, err)
	return now
}

func (s bundle) claimOne(t *testing.T, owner, key string, ttl time.Duration) queue.Item {
	t.Helper()
	items, err := queue.Claim(s.ctx, s.db, rec, owner, []int{coord.ShardOf(key)}, 10, ttl)
	require.NoError(t, err)
	for _, it := range items {
		if it.Key == key {
			return it
		}
	}
	t.Fatalf("%s could not claim %s (got %d items)", owner, key, len(items))
	return queue.Item{}
}

func keysOf(items []queue.Item) []string {
	out := make([]string, len(items))
	for i, it := range items {
		out[i] = it.Key
	}
	return out
}

// keyInShard finds a key "<prefix>-<n>" that maps to shard.
func keyInShard(prefix string, shard int) string {
	for i := 0; ; i++ {
		k := fmt.Sprintf("%s-%d", prefix, i)
		if coord.ShardOf(k) == shard {
			return k
		}
	}
}

func TestEnqueueBumpsGenerationAndPullsDueEarlierNeverLater(t *testing.T) {
	t.Parallel()
	s := setup(t)

	it, err := queue.Enqueue(s.ctx, s.db, rec, "node-1", time.Hour)
	require.NoError(t, err)
	require.EqualValues(t, 1, it.Generation)
	require.Equal(t, coord.ShardOf("node-1"), it.Shard)
	require.Empty(t, it.Owner)
	firstDue := it.DueAt
	require.WithinDuration(t, s.now(t).Add(time.Hour), firstDue, 5*time.Second)

	// A later due time never postpones the key.
	it, err = queue.Enqueue(s.ctx, s.db, rec, "node-1", 2*time.Hour)
	require.NoError(t, err)
	require.EqualValues(t, 2, it.Generation)
	require.True(t, it.DueAt.Equal(firstDue), "due_at moved later: %s -> %s", firstDue, it.DueAt)

	// An earlier one pulls it in.
	it, err = queue.Enqueue(s.ctx, s.db, rec, "node-1", 0)
	require.NoError(t, err)
	require.EqualValues(t, 3, it.Generation)
	require.True(t, it.DueAt.Before(firstDue.Add(-50*time.Minute)))
	require.False(t, it.DueAt.After(s.now(t)))
	require.Zero(t, it.Attempts)

	// Batches: duplicates count once, existing keys bump, new ones start at 1.
	n, err := queue.EnqueueMany(s.ctx, s.db, rec, []string{"node-2", "node-1", "node-2", "node-3"}, time.Minute)
	require.NoError(t, err)
	require.Equal(t, 3, n)
	r1, ok := s.row(t, "node-1")
	require.True(t, ok)
	require.EqualValues(t, 4, r1.Generation)
	require.LessOrEqual(t, r1.DueIn, time.Duration(0), "a batch never postpones node-1")
	r2, ok := s.row(t, "node-2")
	require.True(t, ok)
	require.EqualValues(t, 1, r2.Generation)
	require.InDelta(t, time.Minute.Seconds(), r2.DueIn.Seconds(), 5)

	// Same key under another reconciler is another row.
	it, err = queue.Enqueue(s.ctx, s.db, "site", "node-1", 0)
	require.NoError(t, err)
	require.EqualValues(t, 1, it.Generation)
	require.Equal(t, 4, s.count(t))

	n, err = queue.EnqueueMany(s.ctx, s.db, rec, nil, 0)
	require.NoError(t, err)
	require.Zero(t, n)
}

func TestClaimTakesOnlyDueKeysOfGivenShards(t *testing.T) {
	t.Parallel()
	s := setup(t)

	a3, a4 := keyInShard("a", 3), keyInShard("b", 3)
	b7 := keyInShard("c", 7)
	c9 := keyInShard("d", 9)
	later := keyInShard("e", 3)
	for _, k := range []string{a3, a4, b7, c9} {
		_, err := queue.Enqueue(s.ctx, s.db, rec, k, 0)
		require.NoError(t, err)
	}
	_, err := queue.Enqueue(s.ctx, s.db, rec, later, time.Hour)
	require.NoError(t, err)
	_, err = queue.Enqueue(s.ctx, s.db, "other", a3, 0) // another reconciler
	require.NoError(t, err)

	before := s.now(t)
	items, err := queue.Claim(s.ctx, s.db, rec, "worker-a", []int{3, 7}, 100, time.Minute)
	require.NoError(t, err)
	require.ElementsMatch(t, []string{a3, a4, b7}, keysOf(items))
	for _, it := range items {
		require.Equal(t, rec, it.Reconciler)
		require.Contains(t, []int{3, 7}, it.Shard)
		require.Equal(t, "worker-a", it.Owner)
		require.Equal(t, 1, it.Attempts)
		require.EqualValues(t, 1, it.Generation)
		require.False(t, it.DueAt.After(before))
		require.WithinDuration(t, before.Add(time.Minute), it.ClaimedUntil, 5*time.Second)
	}

	// Claimed keys are not claimable by anyone while the claim lives.
	items, err = queue.Claim(s.ctx, s.db, rec, "worker-b", allShards, 100, time.Minute)
	require.NoError(t, err)
	require.Equal(t, []string{c9}, keysOf(items), "only the unclaimed due key of shard 9")

	// Limit is honoured, and no shards means nothing.
	for i := range 5 {
		_, err := queue.Enqueue(s.ctx, s.db, rec, fmt.Sprintf("lim-%d", i), 0)
		require.NoError(t, err)
	}
	items, err = queue.Claim(s.ctx, s.db, rec, "worker-b", allShards, 2, time.Minute)
	require.NoError(t, err)
	require.Len(t, items, 2)
	items, err = queue.Claim(s.ctx, s.db, rec, "worker-b", nil, 2, time.Minute)
	require.NoError(t, err)
	require.Empty(t, items)
}

func TestConcurrentClaimersNeverShareAKey(t *testing.T) {
	t.Parallel()
	s := setup(t)
	const nkeys, nworkers = 200, 8
	keys := make([]string, nkeys)
	for i := range keys {
		keys[i] = fmt.Sprintf("node-%03d", i)
	}
	n, err := queue.EnqueueMany(s.ctx, s.db, rec, keys, 0)
	require.NoError(t, err)
	require.Equal(t, nkeys, n)

	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		owner = map[string]string{}
		dups  []string
		errs  []error
	)
	for w := range nworkers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			me := fmt.Sprintf("worker-%d", w)
			for {
				items, err := queue.Claim(s.ctx, s.db, rec, me, allShards, 7, time.Minute)
				if err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					return
				}
				if len(items) == 0 {
					return
				}
				mu.Lock()
				for _, it := range items {
					if prev, dup := owner[it.Key]; dup {
						dups = append(dups, fmt.Sprintf("%s: %s and %s", it.Key, prev, me))
					}
					owner[it.Key] = me
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	require.Empty(t, errs)
	require.Empty(t, dups, "a key was claimed twice")
	require.Len(t, owner, nkeys, "every key was claimed")
	perWorker := map[string]int{}
	for _, o := range owner {
		perWorker[o]++
	}
	t.Logf("keys per worker: %v", perWorker)
}

func TestExpiredClaimIsClaimableByAnother(t *testing.T) {
	t.Parallel()
	s := setup(t)
	_, err := queue.Enqueue(s.ctx, s.db, rec, "node-x", 0)
	require.NoError(t, err)
	shard := []int{coord.ShardOf("node-x")}

	stale := s.claimOne(t, "worker-a", "node-x", 50*time.Millisecond)
	items, err := queue.Claim(s.ctx, s.db, rec, "worker-b", shard, 10, time.Minute)
	require.NoError(t, err)
	require.Empty(t, items, "a live claim is not claimable")

	var taken queue.Item
	require.Eventually(t, func() bool {
		items, err := queue.Claim(s.ctx, s.db, rec, "worker-b", shard, 10, time.Minute)
		if err == nil && len(items) == 1 {
			taken = items[0]
			return true
		}
		return false
	}, 5*time.Second, 10*time.Millisecond)
	require.Equal(t, "worker-b", taken.Owner)
	require.Equal(t, 2, taken.Attempts)
	require.EqualValues(t, 1, taken.Generation)
	require.True(t, taken.DueAt.Equal(stale.ClaimedUntil), "waiting since the dead claim's end")

	// The stale run can neither complete nor fail the key it lost.
	_, err = queue.Complete(s.ctx, s.db, stale)
	require.ErrorIs(t, err, queue.ErrClaimLost)
	_, err = queue.Fail(s.ctx, s.db, stale, errors.New("late"), queue.Backoff{})
	require.ErrorIs(t, err, queue.ErrClaimLost)
	r, ok := s.row(t, "node-x")
	require.True(t, ok)
	require.Equal(t, "worker-b", *r.Owner)
	require.Nil(t, r.LastError)

	done, err := queue.Complete(s.ctx, s.db, taken)
	require.NoError(t, err)
	require.Equal(t, queue.Deleted, done)
	require.Zero(t, s.count(t))
}

// TestCompleteAtOldGenerationKeepsNewEnqueue is the generation race: a key
// enqueued while it runs is not deleted by the run's Complete, and runs again.
func TestCompleteAtOldGenerationKeepsNewEnqueue(t *testing.T) {
	t.Parallel()
	s := setup(t)
	_, err := queue.Enqueue(s.ctx, s.db, rec, "node-g", 0)
	require.NoError(t, err)
	run1 := s.claimOne(t, "worker-a", "node-g", time.Minute)
	require.EqualValues(t, 1, run1.Generation)

	// Enqueued during the run.
	_, err = queue.Enqueue(s.ctx, s.db, rec, "node-g", 0)
	require.NoError(t, err)

	done, err := queue.Complete(s.ctx, s.db, run1)
	require.NoError(t, err)
	require.Equal(t, queue.Rearmed, done)
	r, ok := s.row(t, "node-g")
	require.True(t, ok, "the wake-up during the run was lost")
	require.EqualValues(t, 2, r.Generation)
	require.Zero(t, r.Attempts)
	require.Nil(t, r.Owner)
	require.LessOrEqual(t, r.DueIn, time.Duration(0))

	run2 := s.claimOne(t, "worker-b", "node-g", time.Minute)
	require.EqualValues(t, 2, run2.Generation)
	require.Equal(t, 1, run2.Attempts)
	done, err = queue.Complete(s.ctx, s.db, run2)
	require.NoError(t, err)
	require.Equal(t, queue.Deleted, done)
	require.Zero(t, s.count(t))
}

// TestEnqueueDuringRunKeepsItsDelay: a "check again in an hour" enqueued by
// the run itself re-arms the key for an hour, not for now.
func TestEnqueueDuringRunKeepsItsDelay(t *testing.T) {
	t.Parallel()
	s := setup(t)
	_, err := queue.Enqueue(s.ctx, s.db, rec, "node-d", 0)
	require.NoError(t, err)
	run := s.claimOne(t, "worker-a", "node-d", time.Minute)
	_, err = queue.Enqueue(s.ctx, s.db, rec, "node-d", time.Hour)
	require.NoError(t, err)
	_, err = queue.Enqueue(s.ctx, s.db, rec, "node-d", 2*time.Hour)
	require.NoError(t, err)

	done, err := queue.Complete(s.ctx, s.db, run)
	require.NoError(t, err)
	require.Equal(t, queue.Rearmed, done)
	r, ok := s.row(t, "node-d")
	require.True(t, ok)
	require.InDelta(t, time.Hour.Seconds(), r.DueIn.Seconds(), 5, "the earliest enqueue during the run sets the next due time")
	items, err := queue.Claim(s.ctx, s.db, rec, "worker-a", allShards, 10, time.Minute)
	require.NoError(t, err)
	require.Empty(t, items)
}

// TestCompleteRacesEnqueue runs both orders of a Complete and an Enqueue in
// open transactions: the row lock orders them, and the wake-up survives.
func TestCompleteRacesEnqueue(t *testing.T) {
	t.Parallel()
	s := setup(t)

	t.Run("complete first", func(t *testing.T) {
		_, err := queue.Enqueue(s.ctx, s.db, rec, "node-r1", 0)
		require.NoError(t, err)
		run := s.claimOne(t, "worker-a", "node-r1", time.Minute)
		tx, err := s.db.Begin(s.ctx)
		require.NoError(t, err)
		done, err := queue.Complete(s.ctx, tx, run)
		require.NoError(t, err)
		require.Equal(t, queue.Deleted, done)

		enq := make(chan error, 1)
		go func() {
			_, err := queue.Enqueue(s.ctx, s.db, rec, "node-r1", 0)
			enq <- err
		}()
		waitForLockWait(t, s, "INSERT INTO work_queue")
		require.NoError(t, tx.Commit(s.ctx))
		require.NoError(t, <-enq)
		r, ok := s.row(t, "node-r1")
		require.True(t, ok, "the enqueue after the delete survives")
		require.EqualValues(t, 1, r.Generation)
		require.Nil(t, r.Owner)
	})

	t.Run("enqueue first", func(t *testing.T) {
		_, err := queue.Enqueue(s.ctx, s.db, rec, "node-r2", 0)
		require.NoError(t, err)
		run := s.claimOne(t, "worker-a", "node-r2", time.Minute)
		tx, err := s.db.Begin(s.ctx)
		require.NoError(t, err)
		_, err = queue.Enqueue(s.ctx, tx, rec, "node-r2", 0)
		require.NoError(t, err)

		type res struct {
			c   queue.Completion
			err error
		}
		comp := make(chan res, 1)
		go func() {
			c, err := queue.Complete(s.ctx, s.db, run)
			comp <- res{c, err}
		}()
		waitForLockWait(t, s, "DELETE FROM work_queue")
		require.NoError(t, tx.Commit(s.ctx))
		r := <-comp
		require.NoError(t, r.err)
		require.Equal(t, queue.Rearmed, r.c)
		row, ok := s.row(t, "node-r2")
		require.True(t, ok)
		require.EqualValues(t, 2, row.Generation)
		require.Nil(t, row.Owner)
	})
}

func waitForLockWait(t *testing.T, s bundle, query string) {
	t.Helper()
	require.Eventually(t, func() bool {
		var n int
		_ = s.db.QueryRow(s.ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%'||$1||'%'`, query).Scan(&n)
		return n == 1
	}, 5*time.Second, 5*time.Millisecond)
}

func TestFailRecordsErrorAndBacksOff(t *testing.T) {
	t.Parallel()
	s := setup(t)
	_, err := queue.Enqueue(s.ctx, s.db, rec, "node-f", 0)
	require.NoError(t, err)
	bo := queue.Backoff{Base: 10 * time.Second, Max: 40 * time.Second, Rand: func() float64 { return 0.999 }}

	run := s.claimOne(t, "worker-a", "node-f", time.Minute)
	require.Equal(t, 1, run.Attempts)
	// A long message with bytes PostgreSQL's text refuses.
	msg := "boom: \x00 \xff " + strings.Repeat("é", 3000)
	before := s.now(t)
	due, err := queue.Fail(s.ctx, s.db, run, errors.New(msg), bo)
	require.NoError(t, err)
	after := s.now(t)
	require.False(t, due.Before(before), "due_at is not in the past")
	require.False(t, due.After(after.Add(bo.Cap(1))), "due_at is within the first cap")
	require.Greater(t, due.Sub(before), 9*time.Second, "Rand 0.999 draws near the cap")

	r, ok := s.row(t, "node-f")
	require.True(t, ok)
	require.Equal(t, 1, r.Attempts, "Fail keeps the attempt")
	require.Nil(t, r.Owner)
	require.NotNil(t, r.LastError)
	require.LessOrEqual(t, len(*r.LastError), queue.MaxErrorLen)
	require.True(t, utf8.ValidString(*r.LastError))
	require.True(t, strings.HasPrefix(*r.LastError, "boom: "))
	require.True(t, strings.HasSuffix(*r.LastError, "(truncated)"))

	items, err := queue.Claim(s.ctx, s.db, rec, "worker-a", allShards, 10, time.Minute)
	require.NoError(t, err)
	require.Empty(t, items, "backing off")

	// An enqueue pulls it in but keeps the attempts; the next failure backs
	// off further (cap 20 s for the second attempt).
	_, err = queue.Enqueue(s.ctx, s.db, rec, "node-f", 0)
	require.NoError(t, err)
	run = s.claimOne(t, "worker-b", "node-f", time.Minute)
	require.Equal(t, 2, run.Attempts)
	require.Equal(t, "boom: ", run.LastError[:6])
	before = s.now(t)
	due, err = queue.Fail(s.ctx, s.db, run, nil, bo)
	require.NoError(t, err)
	require.Greater(t, due.Sub(before), 19*time.Second)
	require.LessOrEqual(t, due.Sub(before), bo.Cap(2)+time.Second)
	r, _ = s.row(t, "node-f")
	require.Equal(t, 2, r.Attempts)
	require.Equal(t, "run failed without an error", *r.LastError)
}

func TestReleaseClaimsHandsKeysBackAtOnce(t *testing.T) {
	t.Parallel()
	s := setup(t)
	n, err := queue.EnqueueMany(s.ctx, s.db, rec, []string{"n1", "n2", "n3"}, 0)
	require.NoError(t, err)
	require.Equal(t, 3, n)
	items, err := queue.Claim(s.ctx, s.db, rec, "worker-a", allShards, 2, time.Hour)
	require.NoError(t, err)
	require.Len(t, items, 2)
	// Enqueued during the run, for later: the release still makes it due now.
	_, err = queue.Enqueue(s.ctx, s.db, rec, items[0].Key, time.Hour)
	require.NoError(t, err)

	released, err := queue.ReleaseClaims(s.ctx, s.db, "worker-a")
	require.NoError(t, err)
	require.Equal(t, 2, released)
	again, err := queue.Claim(s.ctx, s.db, rec, "worker-b", allShards, 10, time.Hour)
	require.NoError(t, err)
	require.Len(t, again, 3)
	for _, it := range again {
		require.Equal(t, 1, it.Attempts, "a released claim is not a failed attempt")
	}
	released, err = queue.ReleaseClaims(s.ctx, s.db, "worker-a")
	require.NoError(t, err)
	require.Zero(t, released)
}

func TestDepth(t *testing.T) {
	t.Parallel()
	s := setup(t)
	_, err := queue.EnqueueMany(s.ctx, s.db, rec, []string{"n1", "n2", "n3", "n4"}, 0)
	require.NoError(t, err)
	_, err = queue.Enqueue(s.ctx, s.db, rec, "n5", time.Hour)
	require.NoError(t, err)
	_, err = queue.Enqueue(s.ctx, s.db, "site", "s1", 0)
	require.NoError(t, err)
	// n1 has waited 10 min; n2 is claimed; n3's claim has expired.
	_, err = s.db.Exec(s.ctx, "UPDATE work_queue SET due_at = compute_now() - interval '10 minutes' WHERE key = 'n1'")
	require.NoError(t, err)
	s.claimOne(t, "worker-a", "n2", time.Hour)
	s.claimOne(t, "worker-a", "n3", time.Hour)
	_, err = s.db.Exec(s.ctx, "UPDATE work_queue SET claimed_until = compute_now() - interval '1 minute' WHERE key = 'n3'")
	require.NoError(t, err)

	d, err := queue.Depth(s.ctx, s.db)
	require.NoError(t, err)
	require.Len(t, d, 2)
	st := d[rec]
	require.EqualValues(t, 5, st.Total)
	require.EqualValues(t, 3, st.Due, "n1, n4 and the expired n3")
	require.EqualValues(t, 1, st.Claimed)
	require.EqualValues(t, 1, st.ExpiredClaims)
	require.EqualValues(t, 1, st.Overdue)
	require.InDelta(t, (10 * time.Minute).Seconds(), st.OldestDue.Seconds(), 5)
	require.EqualValues(t, 1, d["site"].Total)
	require.EqualValues(t, 1, d["site"].Due)
}

func TestBadInputIsRefusedBeforeSQL(t *testing.T) {
	t.Parallel()
	s := setup(t)
	// Any SQL on this pool would fail with a connection error, not a
	// *ValidationError.
	dead, err := pgxpool.New(s.ctx, "postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	require.NoError(t, err)
	defer dead.Close()

	good := queue.Item{Reconciler: rec, Key: "k", Generation: 1, Owner: "worker-a", ClaimedUntil: time.Now()}
	withItem := func(f func(*queue.Item)) queue.Item { it := good; f(&it); return it }
	cases := []struct {
		name  string
		field string
		call  func(db queue.Querier) error
	}{
		{"empty reconciler", "reconciler", func(db queue.Querier) error { _, err := queue.Enqueue(s.ctx, db, "", "k", 0); return err }},
		{"upper-case reconciler", "reconciler", func(db queue.Querier) error { _, err := queue.Enqueue(s.ctx, db, "Node", "k", 0); return err }},
		{"long reconciler", "reconciler", func(db queue.Querier) error {
			_, err := queue.Enqueue(s.ctx, db, strings.Repeat("a", 101), "k", 0)
			return err
		}},
		{"injection reconciler", "reconciler", func(db queue.Querier) error {
			_, err := queue.Enqueue(s.ctx, db, "x'; DROP TABLE work_queue; --", "k", 0)
			return err
		}},
		{"empty key", "key", func(db queue.Querier) error { _, err := queue.Enqueue(s.ctx, db, rec, "", 0); return err }},
		{"long key", "key", func(db queue.Querier) error {
			_, err := queue.Enqueue(s.ctx, db, rec, strings.Repeat("é", 251), 0)
			return err
		}},
		{"invalid utf-8 key", "key", func(db queue.Querier) error { _, err := queue.Enqueue(s.ctx, db, rec, "a\xffb", 0); return err }},
		{"nul key", "key", func(db queue.Querier) error { _, err := queue.Enqueue(s.ctx, db, rec, "a\x00b", 0); return err }},
		{"negative delay", "delay", func(db queue.Querier) error { _, err := queue.Enqueue(s.ctx, db, rec, "k", -time.Second); return err }},
		{"one bad key in a batch", "key", func(db queue.Querier) error {
			_, err := queue.EnqueueMany(s.ctx, db, rec, []string{"ok-1", "ok-2", "bad\x00"}, 0)
			return err
		}},
		{"bad owner", "owner", func(db queue.Querier) error {
			_, err := queue.Claim(s.ctx, db, rec, "has space", allShards, 1, time.Second)
			return err
		}},
		{"shard 256", "shards", func(db queue.Querier) error {
			_, err := queue.Claim(s.ctx, db, rec, "w", []int{0, 256}, 1, time.Second)
			return err
		}},
		{"negative shard", "shards", func(db queue.Querier) error {
			_, err := queue.Claim(s.ctx, db, rec, "w", []int{-1}, 1, time.Second)
			return err
		}},
		{"zero limit", "limit", func(db queue.Querier) error {
			_, err := queue.Claim(s.ctx, db, rec, "w", allShards, 0, time.Second)
			return err
		}},
		{"sub-ms claim TTL", "claimTTL", func(db queue.Querier) error {
			_, err := queue.Claim(s.ctx, db, rec, "w", allShards, 1, 1500*time.Microsecond)
			return err
		}},
		{"zero claim TTL", "claimTTL", func(db queue.Querier) error {
			_, err := queue.Claim(s.ctx, db, rec, "w", allShards, 1, 0)
			return err
		}},
		{"unclaimed item", "item", func(db queue.Querier) error {
			_, err := queue.Complete(s.ctx, db, withItem(func(it *queue.Item) { it.ClaimedUntil = time.Time{} }))
			return err
		}},
		{"item without owner", "owner", func(db queue.Querier) error {
			_, err := queue.Fail(s.ctx, db, withItem(func(it *queue.Item) { it.Owner = "" }), errors.New("x"), queue.Backoff{})
			return err
		}},
		{"bad back-off", "backoff", func(db queue.Querier) error {
			_, err := queue.Fail(s.ctx, db, good, errors.New("x"), queue.Backoff{Base: time.Minute, Max: time.Second})
			return err
		}},
		{"release with bad owner", "owner", func(db queue.Querier) error { _, err := queue.ReleaseClaims(s.ctx, db, ""); return err }},
	}
	for _, c := range cases {
		for _, db := range []queue.Querier{s.db, dead} {
			err := c.call(db)
			var ve *queue.ValidationError
			require.ErrorAs(t, err, &ve, c.name)
			require.ErrorIs(t, err, queue.ErrInvalidInput, c.name)
			require.Equal(t, c.field, ve.Field, c.name)
			require.NotEmpty(t, ve.Reason, c.name)
		}
	}
	require.Zero(t, s.count(t), "nothing was written")

	// The edges are valid.
	_, err = queue.Enqueue(s.ctx, s.db, strings.Repeat("a", 100), strings.Repeat("é", 250), 0)
	require.NoError(t, err)
	require.Equal(t, 1, s.count(t))
}

// TestFencedCompleteWithLostLeaseCommitsNothing: a worker whose shard lease
// was taken over cannot complete the key: the fence fails and the key stays.
// The new holder runs it once the old claim expires.
func TestFencedCompleteWithLostLeaseCommitsNothing(t *testing.T) {
	t.Parallel()
	s := setup(t)
	a, err := coord.NewClient(s.db, "worker-a")
	require.NoError(t, err)
	b, err := coord.NewClient(s.db, "worker-b")
	require.NoError(t, err)
	const key = "node-fenced"
	lease := fmt.Sprintf("shard:%d", coord.ShardOf(key))

	_, err = queue.Enqueue(s.ctx, s.db, rec, key, 0)
	require.NoError(t, err)
	la, ok, err := a.Acquire(s.ctx, lease, 100*time.Millisecond)
	require.NoError(t, err)
	require.True(t, ok)
	run := s.claimOne(t, a.Owner(), key, 300*time.Millisecond)

	// A stalls; B takes the shard after A's lease expires.
	var lb coord.Lease
	require.Eventually(t, func() bool {
		l, ok, err := b.Acquire(s.ctx, lease, time.Minute)
		lb = l
		return err == nil && ok
	}, 5*time.Second, 10*time.Millisecond)
	require.Equal(t, la.Epoch+1, lb.Epoch)

	la.ValidUntil = time.Time{} // the stalled process still believes in its lease
	err = coord.RunFenced(s.ctx, s.db, la, coord.FenceOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		_, err := queue.Complete(ctx, tx, run)
		return err
	})
	require.ErrorIs(t, err, coord.ErrLeaseLost)
	r, ok := s.row(t, key)
	require.True(t, ok, "the fenced Complete committed nothing")
	require.Equal(t, "worker-a", *r.Owner)

	// B claims it after A's claim expires, and completes under its lease.
	var taken queue.Item
	require.Eventually(t, func() bool {
		items, err := queue.Claim(s.ctx, s.db, rec, b.Owner(), []int{coord.ShardOf(key)}, 10, time.Minute)
		if err == nil && len(items) == 1 {
			taken = items[0]
			return true
		}
		return false
	}, 5*time.Second, 10*time.Millisecond)
	err = b.RunFenced(s.ctx, lb, func(ctx context.Context, tx pgx.Tx) error {
		done, err := queue.Complete(ctx, tx, taken)
		if err == nil && done != queue.Deleted {
			err = fmt.Errorf("completion %s", done)
		}
		return err
	})
	require.NoError(t, err)
	_, ok = s.row(t, key)
	require.False(t, ok)
}
