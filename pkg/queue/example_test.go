package queue_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/queue"
)

// A producer enqueues a key in the transaction that makes the change the key
// must react to; a worker that holds the key's shard lease claims it, runs
// it in a transaction fenced on that lease and completes it there, so the
// run's writes and the key's deletion commit together or not at all.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pgtest.ExampleURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `CREATE TABLE images (name text PRIMARY KEY, wanted text NOT NULL, built text)`); err != nil {
		log.Fatal(err)
	}

	// The producer: the change and its wake-up in one transaction.
	err = pgdb.InTx(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO images (name, wanted) VALUES ('base', 'v2')`); err != nil {
			return err
		}
		_, err := queue.Enqueue(ctx, tx, "image-builder", "base", 0)
		return err
	})
	if err != nil {
		log.Fatal(err)
	}

	// The worker: hold the key's shard lease (a real worker holds its share
	// of all coord.NumShards through the renewal loop), then claim.
	worker, err := coord.NewClient(pool, "worker-1")
	if err != nil {
		log.Fatal(err)
	}
	shard := coord.ShardOf("base")
	lease, ok, err := worker.Acquire(ctx, coord.ShardLeaseName("image-builder:", shard), 30*time.Second)
	if err != nil || !ok {
		log.Fatal("shard lease: ", ok, err)
	}
	items, err := queue.Claim(ctx, pool, "image-builder", worker.Owner(), []int{shard}, 10, time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	for _, it := range items {
		fmt.Println("claimed:", it.Key, "attempt", it.Attempts)
		var done queue.Completion
		err := worker.RunFenced(ctx, lease, func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `UPDATE images SET built = wanted WHERE name = $1`, it.Key); err != nil {
				return err
			}
			var err error
			done, err = queue.Complete(ctx, tx, it)
			return err
		})
		if err != nil {
			// The run rolled back: record the failure; the key runs again
			// after a back-off.
			if _, ferr := queue.Fail(ctx, pool, it, err, queue.Backoff{}); ferr != nil {
				log.Fatal(ferr)
			}
			continue
		}
		fmt.Println("completed:", it.Key, done)
	}

	var built string
	if err := pool.QueryRow(ctx, `SELECT built FROM images WHERE name = 'base'`).Scan(&built); err != nil {
		log.Fatal(err)
	}
	stats, err := queue.Depth(ctx, pool)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("built:", built, "still queued:", stats["image-builder"].Total)
	// Output:
	// claimed: base attempt 1
	// completed: base deleted
	// built: v2 still queued: 0
}

// An enqueue while the key runs is not lost: Complete keeps the key
// (Rearmed) instead of deleting it, and the next claim runs it again.
func ExampleComplete() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pgtest.ExampleURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	if _, err := queue.Enqueue(ctx, pool, "dns", "node-7", 0); err != nil {
		log.Fatal(err)
	}
	// For brevity the runs here are not fenced; a worker holds the shard's
	// lease and completes inside a fenced transaction, as in the package
	// example.
	shards := []int{coord.ShardOf("node-7")}
	claimed, err := queue.Claim(ctx, pool, "dns", "worker-1", shards, 1, time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	// While the run is in progress, the node changes again.
	if _, err := queue.Enqueue(ctx, pool, "dns", "node-7", 0); err != nil {
		log.Fatal(err)
	}
	done, err := queue.Complete(ctx, pool, claimed[0])
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("first run:", done)

	again, err := queue.Claim(ctx, pool, "dns", "worker-1", shards, 1, time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	done, err = queue.Complete(ctx, pool, again[0])
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("second run:", done)
	// Output:
	// first run: rearmed
	// second run: deleted
}

// A failed run goes back to the queue with Fail, due again after a back-off
// that grows with the key's attempts; the error stays on the row for the
// next run (and for doctor) to see. A new enqueue may pull the key earlier,
// and the attempts are kept, so the next failure backs off further.
func ExampleFail() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pgtest.ExampleURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	// A fixed draw (the middle of the range), so no retry lands at once.
	backoff := queue.Backoff{Base: time.Minute, Max: time.Hour, Rand: func() float64 { return 0.5 }}

	if _, err := queue.Enqueue(ctx, pool, "dns", "node-3", 0); err != nil {
		log.Fatal(err)
	}
	shards := []int{coord.ShardOf("node-3")}
	claimed, err := queue.Claim(ctx, pool, "dns", "worker-1", shards, 1, time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	// The run (fenced in a real worker) failed and rolled back.
	if _, err := queue.Fail(ctx, pool, claimed[0], errors.New("resolver unreachable"), backoff); err != nil {
		log.Fatal(err)
	}
	again, err := queue.Claim(ctx, pool, "dns", "worker-1", shards, 1, time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("claimable during the back-off:", len(again))

	// The node changes: the wake-up pulls the key earlier than its retry.
	if _, err := queue.Enqueue(ctx, pool, "dns", "node-3", 0); err != nil {
		log.Fatal(err)
	}
	again, err = queue.Claim(ctx, pool, "dns", "worker-1", shards, 1, time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	it := again[0]
	fmt.Printf("claimed again: attempt %d, last error %q\n", it.Attempts, it.LastError)
	fmt.Println("next failure waits up to:", backoff.Cap(it.Attempts))
	// Output:
	// claimable during the back-off: 0
	// claimed again: attempt 2, last error "resolver unreachable"
	// next failure waits up to: 2m0s
}

// Backoff draws a failed key's delay from [0, Cap(attempts)]: the cap
// doubles with every failed attempt up to Max. Rand is set here only so the
// example prints the same delays every time; left nil it is math/rand/v2's.
func ExampleBackoff() {
	b := queue.Backoff{Base: time.Second, Max: time.Minute, Rand: func() float64 { return 0.5 }}
	for attempts := 1; attempts <= 8; attempts++ {
		fmt.Printf("attempt %d failed: wait up to %v, drawn %v\n", attempts, b.Cap(attempts), b.Delay(attempts))
	}
	// Output:
	// attempt 1 failed: wait up to 1s, drawn 500ms
	// attempt 2 failed: wait up to 2s, drawn 1s
	// attempt 3 failed: wait up to 4s, drawn 2s
	// attempt 4 failed: wait up to 8s, drawn 4s
	// attempt 5 failed: wait up to 16s, drawn 8s
	// attempt 6 failed: wait up to 32s, drawn 16s
	// attempt 7 failed: wait up to 1m0s, drawn 30s
	// attempt 8 failed: wait up to 1m0s, drawn 30s
}
