package coord_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// Take grants a lease inside the caller's own statement or transaction: the
// first owner gets it, a second is refused while it is live, and the holder
// taking it again keeps its epoch.
func ExampleTake() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pgtest.ExampleURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	first, ok, err := coord.Take(ctx, pool, "site:berlin:boot", "agent-a", 30*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("agent-a took it:", ok)

	_, ok, err = coord.Take(ctx, pool, "site:berlin:boot", "agent-b", 30*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("agent-b took it:", ok)

	again, ok, err := coord.Take(ctx, pool, "site:berlin:boot", "agent-a", 30*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("agent-a again:", ok, "same epoch:", again.Epoch == first.Epoch)

	fresh, ok, err := coord.TakeFresh(ctx, pool, "site:berlin:boot", "agent-a", 30*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("agent-a fresh:", ok, "new epoch:", fresh.Epoch > again.Epoch)
	// Output:
	// agent-a took it: true
	// agent-b took it: false
	// agent-a again: true same epoch: true
	// agent-a fresh: true new epoch: true
}

// A Keeper holds one lease for the life of a process (a singleton, a
// gateway's own lease) and runs the writes made on its behalf fenced on it.
func ExampleKeeper() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pgtest.ExampleURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `CREATE TABLE reports (day date PRIMARY KEY, written_by text NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	client, err := coord.NewClient(pool, "reporter-1")
	if err != nil {
		log.Fatal(err)
	}
	keeper, err := coord.NewKeeper(client, coord.KeeperConfig{
		Name:  "singleton:daily-report",
		TTL:   10 * time.Second,
		Renew: time.Second,
		OnLost: func(l coord.Lease, reason string) {
			log.Printf("stopped trusting %s at epoch %d: %s", l.Name, l.Epoch, reason)
		},
	}, nil)
	if err != nil {
		log.Fatal(err)
	}
	acquired := keeper.Acquired() // before Run, so the first holding is not missed
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		keeper.Run(runCtx)
	}()

	select {
	case <-acquired:
	case <-time.After(30 * time.Second):
		log.Fatal("no lease: ", keeper.Err())
	}
	_, held := keeper.Current()
	fmt.Println("held:", held)

	err = keeper.RunFenced(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO reports VALUES ('2026-12-06', 'reporter-1')`)
		return err
	})
	fmt.Println("fenced write:", err)

	// A graceful stop: stop renewing, then hand the lease back so a
	// successor need not wait for the TTL.
	stop()
	<-done
	if err := keeper.Release(ctx); err != nil {
		log.Fatal(err)
	}
	_, held = keeper.Current()
	fmt.Println("held after release:", held)
	err = keeper.RunFenced(ctx, pool, func(context.Context, pgx.Tx) error { return nil })
	fmt.Println("fenced write after release refused:", errors.Is(err, coord.ErrNotHeld))
	// Output:
	// held: true
	// fenced write: <nil>
	// held after release: false
	// fenced write after release refused: true
}

// RunFenced commits the writes of a lease holder only while it still holds
// the lease at its epoch: once another owner has taken the lease, the old
// holder's transaction fails its fence and nothing of it commits.
func ExampleRunFenced() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pgtest.ExampleURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `CREATE TABLE configs (name text PRIMARY KEY, body text NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	write := func(body string) func(context.Context, pgx.Tx) error {
		return func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO configs VALUES ('fleet', $1)
				ON CONFLICT (name) DO UPDATE SET body = EXCLUDED.body`, body)
			return err
		}
	}

	old, err := coord.NewClient(pool, "writer-old")
	if err != nil {
		log.Fatal(err)
	}
	l, ok, err := old.Acquire(ctx, "config:fleet", 10*time.Second)
	if err != nil || !ok {
		log.Fatal("acquire: ", ok, err)
	}
	fmt.Println("old holder writes:", coord.RunFenced(ctx, pool, l, coord.FenceOptions{}, write("v1")))

	// The lease moves on (here by a release; after a crash, by its expiry),
	// and a new holder takes it at a higher epoch.
	if _, err := old.Release(ctx, "config:fleet"); err != nil {
		log.Fatal(err)
	}
	successor, err := coord.NewClient(pool, "writer-new")
	if err != nil {
		log.Fatal(err)
	}
	l2, ok, err := successor.Acquire(ctx, "config:fleet", 10*time.Second)
	if err != nil || !ok {
		log.Fatal("acquire: ", ok, err)
	}
	fmt.Println("new epoch is higher:", l2.Epoch > l.Epoch)

	err = coord.RunFenced(ctx, pool, l, coord.FenceOptions{}, write("v2 from a stale holder"))
	fmt.Println("old holder's write refused:", errors.Is(err, coord.ErrLeaseLost))

	var body string
	if err := pool.QueryRow(ctx, `SELECT body FROM configs WHERE name = 'fleet'`).Scan(&body); err != nil {
		log.Fatal(err)
	}
	fmt.Println("config:", body)
	// Output:
	// old holder writes: <nil>
	// new epoch is higher: true
	// old holder's write refused: true
	// config: v1
}

// Acquire takes a lease for a Client's owner or renews it when the owner
// already holds it: the epoch (the fencing token) stays the same across
// renewals and rises only when the lease changes hands. Another owner is refused while the
// lease is live and gets it once it has been released.
func ExampleClient_Acquire() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pgtest.ExampleURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	a, err := coord.NewClient(pool, "scheduler-a")
	if err != nil {
		log.Fatal(err)
	}
	b, err := coord.NewClient(pool, "scheduler-b")
	if err != nil {
		log.Fatal(err)
	}

	first, ok, err := a.Acquire(ctx, "singleton:scheduler", 10*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("a acquired:", ok)

	renewed, ok, err := a.Acquire(ctx, "singleton:scheduler", 10*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("a renewed:", ok, "same epoch:", renewed.Epoch == first.Epoch)

	_, ok, err = b.Acquire(ctx, "singleton:scheduler", 10*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("b while a holds it:", ok)

	released, err := a.Release(ctx, "singleton:scheduler")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("a released:", released)

	taken, ok, err := b.Acquire(ctx, "singleton:scheduler", 10*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("b after the release:", ok, "higher epoch:", taken.Epoch > first.Epoch)
	// Output:
	// a acquired: true
	// a renewed: true same epoch: true
	// b while a holds it: false
	// a released: [singleton:scheduler]
	// b after the release: true higher epoch: true
}

// AcquireMany takes or renews many leases in one statement; the names
// another owner holds live are simply absent from the grant.
func ExampleClient_AcquireMany() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pgtest.ExampleURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	a, err := coord.NewClient(pool, "worker-a")
	if err != nil {
		log.Fatal(err)
	}
	b, err := coord.NewClient(pool, "worker-b")
	if err != nil {
		log.Fatal(err)
	}
	shards := []string{coord.ShardLeaseName("sweep:", 0), coord.ShardLeaseName("sweep:", 1), coord.ShardLeaseName("sweep:", 2)}
	if _, ok, err := b.Acquire(ctx, shards[1], 10*time.Second); err != nil || !ok {
		log.Fatal("b: ", ok, err)
	}

	g, err := a.AcquireMany(ctx, shards, 10*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	for _, name := range shards {
		_, held := g.Get(name)
		fmt.Printf("%s held by a: %v\n", name, held)
	}
	// Output:
	// sweep:shard:0 held by a: true
	// sweep:shard:1 held by a: false
	// sweep:shard:2 held by a: true
}
