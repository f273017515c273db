// Command riverclient is one River client (github.com/riverqueue/river,
// riverpgxv5) for the benches that compare leasehold with River on the same
// PostgreSQL server. In -mode leader it works nothing and prints
// "LEADER <unix-nanos>" when its leader-only work starts (River's
// HookPeriodicJobsStart, run by the elected leader's periodic job
// enqueuer); SIGTERM stops it gracefully (River resigns leadership). In
// -mode work it works bench jobs with -workers goroutines until SIGTERM.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"
)

// NoopArgs is the bench job: inserted, worked (nothing to do), completed.
type NoopArgs struct {
	N int `json:"n"`
}

// Kind is the job kind.
func (NoopArgs) Kind() string { return "bench_noop" }

type noopWorker struct {
	river.WorkerDefaults[NoopArgs]
}

func (noopWorker) Work(context.Context, *river.Job[NoopArgs]) error { return nil }

func main() {
	dbURL := flag.String("database-url", "", "PostgreSQL URL of a River-migrated database")
	id := flag.String("id", "", "River client id")
	mode := flag.String("mode", "leader", "leader or work")
	workers := flag.Int("workers", 10, "work: MaxWorkers of the default queue")
	flag.Parse()
	if *dbURL == "" || *id == "" {
		fmt.Fprintln(os.Stderr, "riverclient: -database-url and -id are required")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	pool, err := pgxpool.New(ctx, *dbURL)
	if err != nil {
		fmt.Fprintln(os.Stderr, "riverclient:", err)
		os.Exit(1)
	}
	defer pool.Close()
	ws := river.NewWorkers()
	river.AddWorker(ws, noopWorker{})
	cfg := &river.Config{
		ID:      *id,
		Logger:  slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
		Workers: ws,
		Queues:  map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: *workers}},
		Hooks: []rivertype.Hook{river.HookPeriodicJobsStartFunc(func(context.Context, *rivertype.HookPeriodicJobsStartParams) error {
			fmt.Printf("LEADER %d\n", time.Now().UnixNano())
			return nil
		})},
	}
	if *mode == "leader" {
		cfg.Queues = map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 1}}
	}
	client, err := river.NewClient(riverpgxv5.New(pool), cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "riverclient:", err)
		os.Exit(1)
	}
	if err := client.Start(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, "riverclient: start:", err)
		os.Exit(1)
	}
	fmt.Println("STARTED")
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := client.Stop(sctx); err != nil {
		fmt.Fprintln(os.Stderr, "riverclient: stop:", err)
		os.Exit(1)
	}
}
