// Package runs drives runs (docs/api.md, "Runs"): one command on many
// nodes, at most max_in_flight at a time, stopping new starts once more
// than max_failures nodes failed.
//
// The runs reconciler is sharded by run id under the controllers' shard
// leases. One pass over a run is one transaction fenced on the shard's
// lease: it locks the run row FOR UPDATE (CancelRun locks it too), copies
// the outcome of every finished command to its run_node, ends the run when
// the failure budget is exceeded or no node is left, and otherwise starts
// pending nodes up to the window: for each it inserts the command through
// pkg/cmdstore with the idempotency key run:<run_id>:<node_id> and marks the
// run_node running with the command's id in the same transaction. A worker
// that dies at any point therefore neither skips a node nor starts one
// twice: either the pass committed (the node is running with its command)
// or nothing of it did (the node is still pending and no command exists).
// The gateways are woken (pkg/cmdwake) after the commit.
//
// Wake-ups: CreateRun and CancelRun enqueue the run; the run-wake singleton
// enqueues every run with a finished command when a gateway NOTIFYs
// leasehold_command_done (pkg/pgnotify) and every ScanEvery as the
// fallback; and each pass re-enqueues its running run after Recheck, so a
// run never depends on a wake-up arriving.
package runs

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"golang.org/x/time/rate"

	"github.com/leasehold/leasehold/pkg/cmdstore"
	"github.com/leasehold/leasehold/pkg/cmdwake"
	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgnotify"
	"github.com/leasehold/leasehold/pkg/queue"
	"github.com/leasehold/leasehold/pkg/reconcile"
)

// Reconciler is the work_queue reconciler name of run keys (the api's
// RunsReconciler).
const Reconciler = "runs"

// WakeJob is the singleton that enqueues runs whose commands finished.
const WakeJob = "run-wake"

// Config holds the runs reconciler's timings.
type Config struct {
	// ScanEvery is how often the run-wake singleton looks for runs with a
	// finished command when no notification came (1 s).
	ScanEvery time.Duration
	// Recheck is when a pass over a running run asks to run again, whatever
	// else wakes it (5 s).
	Recheck time.Duration
	// ClaimPoll is how often an idle runs reconciler looks for due runs
	// (100 ms; the runtime's --coord.poll-interval is 500 ms): a run's next
	// wave starts within it of the wake-up.
	ClaimPoll time.Duration
	// NotifyURL is a direct URL to LISTEN for leasehold_command_done on;
	// empty: the scan alone.
	NotifyURL string
}

// DefaultConfig is the defaults.
func DefaultConfig() Config {
	return Config{ScanEvery: time.Second, Recheck: 5 * time.Second, ClaimPoll: 100 * time.Millisecond}
}

// RegisterFlags registers the flags under prefix.
func (c *Config) RegisterFlags(prefix string, f *flag.FlagSet) {
	f.DurationVar(&c.ScanEvery, prefix+"scan-interval", c.ScanEvery, "how often runs with a finished command are looked for, besides the gateways' command-done notification")
	f.DurationVar(&c.Recheck, prefix+"recheck", c.Recheck, "a running run is reconciled again at least this often")
	f.DurationVar(&c.ClaimPoll, prefix+"claim-poll", c.ClaimPoll, "how often an idle runs reconciler looks for due runs (the next wave of a run starts within it)")
}

// Validate checks the configuration.
func (c Config) Validate() error {
	if c.ScanEvery < 10*time.Millisecond || c.Recheck < 10*time.Millisecond || c.ClaimPoll < 10*time.Millisecond {
		return fmt.Errorf("runs: scan-interval %s, recheck %s and claim-poll %s must be >= 10ms", c.ScanEvery, c.Recheck, c.ClaimPoll)
	}
	return nil
}

// Register adds the runs reconciler and the run-wake singleton to rt. wake
// is told of every node that got a command, after the commit.
func Register(rt *reconcile.Runtime, cfg Config, wake *cmdwake.Notifier, log *slog.Logger) error {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if err := rt.RegisterSharded(reconcile.Sharded{Name: Reconciler, Group: coord.Controllers, Poll: cfg.ClaimPoll,
		Reconcile: func(ctx context.Context, tx pgx.Tx, key string) error {
			return Reconcile(ctx, tx, key, cfg, wake)
		}}); err != nil {
		return err
	}
	return rt.RegisterJob(reconcile.Job{Name: WakeJob, Run: func(ctx context.Context, jc *reconcile.JobContext) error {
		return runWake(ctx, jc, cfg, log)
	}})
}

// finishedRunsSQL finds the runs that have a running node whose command is
// terminal. It runs at every batch of finished commands, so it must cost
// the running run nodes, never the commands table: the running nodes come
// from run_nodes_running_idx and each one's command is probed by its
// primary key. The LATERAL ... LIMIT 1 keeps the planner from turning the
// probe into a join that reads the finished commands (a plain join did,
// at 1.3-6.3 ms a call in the throughput bench with no run going).
const finishedRunsSQL = `
SELECT DISTINCT rn.run_id
  FROM run_nodes rn
 CROSS JOIN LATERAL (
   SELECT 1 FROM commands c
    WHERE c.id = rn.command_id AND c.state IN ('succeeded', 'failed', 'cancelled', 'expired')
    LIMIT 1) c
 WHERE rn.state = 'running'
 LIMIT 10000`

// runWake enqueues the runs with a finished command on every
// leasehold_command_done notification and every cfg.ScanEvery.
func runWake(ctx context.Context, jc *reconcile.JobContext, cfg Config, log *slog.Logger) error {
	kick := make(chan struct{}, 1)
	poke := func() {
		select {
		case kick <- struct{}{}:
		default:
		}
	}
	lctx, stop := context.WithCancel(ctx)
	defer stop()
	listening := make(chan struct{})
	if cfg.NotifyURL != "" {
		go func() {
			defer close(listening)
			_ = pgnotify.Listen(lctx, pgnotify.Config{URL: cfg.NotifyURL,
				Handlers:  map[string]func(string){pgnotify.CommandDone: func(string) { poke() }},
				OnConnect: poke,
				OnLost:    func(err error) { log.Debug("run-wake LISTEN lost; scanning only", "err", err) }})
		}()
	} else {
		close(listening)
	}
	defer func() { stop(); <-listening }()
	tick := time.NewTicker(cfg.ScanEvery)
	defer tick.Stop()
	limit := rate.NewLimiter(rate.Every(wakeGap), 1)
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-kick:
		case <-tick.C:
		}
		if err := limit.Wait(ctx); err != nil {
			return err
		}
		err := wakeRuns(ctx, jc)
		if errors.Is(err, coord.ErrLeaseLost) {
			return err
		}
		if err != nil && ctx.Err() == nil {
			log.Warn("run-wake scan failed", "err", err)
		}
	}
}

// wakeGap is the least time between two run-wake scans. The gateways
// notify once per batch of finished commands, which under load is dozens
// of times a second; scans closer than this would find what the next one
// finds anyway, so a burst of notifications costs one scan per gap and a
// run's next nodes start at most this much later.
const wakeGap = 50 * time.Millisecond

// wakeRuns enqueues the runs with a finished command. The read needs no
// fence (an enqueue it causes is fenced, and a run enqueued once too often
// is reconciled to no effect), so a scan that finds nothing, the usual
// case, is one read-only statement rather than a fenced transaction.
func wakeRuns(ctx context.Context, jc *reconcile.JobContext) error {
	rows, err := jc.DB().Query(ctx, finishedRunsSQL)
	if err != nil {
		return fmt.Errorf("find runs with finished commands: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("find runs with finished commands: %w", err)
	}
	if len(ids) == 0 {
		return nil
	}
	return jc.RunFenced(ctx, func(ctx context.Context, tx pgx.Tx) error {
		_, err := queue.EnqueueMany(ctx, tx, Reconciler, ids, 0)
		return err
	})
}

const lockRunSQL = `
SELECT state, max_in_flight, max_failures, (extract(epoch FROM batch_pause) * 1000)::bigint,
       kind, payload, (extract(epoch FROM command_timeout) * 1000)::bigint, compute_now()
  FROM runs WHERE id = $1 FOR UPDATE`

// settleSQL copies each finished command's outcome to its running node: a
// command that expired without ever being acknowledged (its node was not
// connected) makes the node unreachable; one that expired while running
// failed.
const settleSQL = `
UPDATE run_nodes rn
   SET state = CASE c.state WHEN 'succeeded' THEN 'succeeded' WHEN 'failed' THEN 'failed'
                            WHEN 'cancelled' THEN 'cancelled'
                            ELSE CASE WHEN c.acked_at IS NULL THEN 'unreachable' ELSE 'failed' END END,
       exit_code = res.exit_code,
       error = coalesce(nullif(res.error, ''), CASE
                 WHEN c.state = 'expired' AND c.acked_at IS NULL THEN 'node not reached before the command''s deadline'
                 WHEN c.state = 'expired' THEN 'command''s deadline passed while it ran'
                 WHEN c.state = 'cancelled' THEN 'command cancelled' ELSE '' END),
       finished_at = coalesce(c.finished_at, compute_now()),
       updated_at = compute_now()
  FROM commands c
  LEFT JOIN LATERAL (SELECT r.exit_code, r.error FROM command_results_all r WHERE r.command_id = c.id
                      ORDER BY r.received_at, r.id LIMIT 1) res ON true
 WHERE rn.run_id = $1 AND rn.state = 'running' AND c.id = rn.command_id
   AND c.state IN ('succeeded', 'failed', 'cancelled', 'expired')`

// countSQL counts a run's nodes: failures (failed, unreachable or
// cancelled), running, pending, and the last finish of a started node.
const countSQL = `
SELECT count(*) FILTER (WHERE state IN ('failed', 'unreachable', 'cancelled')),
       count(*) FILTER (WHERE state = 'running'),
       count(*) FILTER (WHERE state = 'pending'),
       max(finished_at) FILTER (WHERE state IN ('succeeded', 'failed', 'unreachable', 'cancelled'))
  FROM run_nodes WHERE run_id = $1`

const endRunSQL = `
UPDATE runs SET state = $2, reason = $3, finished_at = compute_now(), updated_at = compute_now()
 WHERE id = $1 AND state = 'running'`

const notStartSQL = `
UPDATE run_nodes SET state = 'not_started', error = $2, finished_at = compute_now(), updated_at = compute_now()
 WHERE run_id = $1 AND state = 'pending'`

const pendingSQL = `
SELECT node_id FROM run_nodes WHERE run_id = $1 AND state = 'pending' ORDER BY node_id LIMIT $2`

const startSQL = `
UPDATE run_nodes rn SET state = 'running', command_id = s.command_id, started_at = compute_now(), updated_at = compute_now()
  FROM unnest($2::text[], $3::text[]) AS s(node_id, command_id)
 WHERE rn.run_id = $1 AND rn.node_id = s.node_id AND rn.state = 'pending'`

const skipSQL = `
UPDATE run_nodes SET state = 'skipped', error = $3, finished_at = compute_now(), updated_at = compute_now()
 WHERE run_id = $1 AND node_id = $2 AND state = 'pending'`

// maxKeyLen is commands.idempotency_key's limit.
const maxKeyLen = 200

// CommandKey is the idempotency key of a run's command on a node:
// run:<run_id>:<node_id>, or run:<run_id> when that would pass 200 bytes
// (keys are scoped to the node, so both are unique per run and node).
func CommandKey(runID, nodeID string) string {
	if k := "run:" + runID + ":" + nodeID; len(k) <= maxKeyLen {
		return k
	}
	return "run:" + runID
}

// Reconcile makes one pass over run runID inside tx, which is fenced on the
// run's shard lease (see the package comment).
func Reconcile(ctx context.Context, tx pgx.Tx, runID string, cfg Config, wake *cmdwake.Notifier) error {
	var (
		state                   string
		inFlight, maxFailures   int
		pauseMs, timeoutMs      int64
		kind                    string
		payload                 []byte
		now                     time.Time
		failures, running, pend int
		lastFinish              *time.Time
		requeue                 = cfg.Recheck
		started                 []string
	)
	err := tx.QueryRow(ctx, lockRunSQL, runID).Scan(&state, &inFlight, &maxFailures, &pauseMs, &kind, &payload, &timeoutMs, &now)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil // deleted
	}
	if err != nil {
		return fmt.Errorf("lock run %s: %w", runID, err)
	}
	if _, err := tx.Exec(ctx, settleSQL, runID); err != nil {
		return fmt.Errorf("settle nodes of run %s: %w", runID, err)
	}
	if err := tx.QueryRow(ctx, countSQL, runID).Scan(&failures, &running, &pend, &lastFinish); err != nil {
		return fmt.Errorf("count nodes of run %s: %w", runID, err)
	}
	pendLeft := 0 // pending nodes that stay pending after this pass
	switch {
	case state != "running":
		// Ended (cancelled, or failed with nodes still running): only the
		// running nodes' outcomes are left to copy.
	case failures > maxFailures:
		noun := "nodes"
		if failures == 1 {
			noun = "node"
		}
		reason := fmt.Sprintf("%d %s failed, more than max_failures %d", failures, noun, maxFailures)
		if _, err := tx.Exec(ctx, endRunSQL, runID, "failed", reason); err != nil {
			return fmt.Errorf("fail run %s: %w", runID, err)
		}
		if _, err := tx.Exec(ctx, notStartSQL, runID, "run failed: "+reason); err != nil {
			return fmt.Errorf("stop pending nodes of run %s: %w", runID, err)
		}
	case pend == 0 && running == 0:
		end, reason := "succeeded", ""
		if failures > 0 {
			end, reason = "failed", fmt.Sprintf("%d nodes failed", failures)
		}
		if _, err := tx.Exec(ctx, endRunSQL, runID, end, reason); err != nil {
			return fmt.Errorf("end run %s: %w", runID, err)
		}
	case running >= inFlight:
		pendLeft = pend // the window is full
	default:
		pause := time.Duration(pauseMs) * time.Millisecond
		pendLeft = pend
		if lastFinish != nil && pause > 0 {
			if left := lastFinish.Add(pause).Sub(now); left > 0 {
				requeue = min(requeue, left)
				break
			}
		}
		if started, err = startNodes(ctx, tx, runID, inFlight-running, cmdstore.Command{
			Kind: kind, Payload: payload, Timeout: time.Duration(timeoutMs) * time.Millisecond}); err != nil {
			return err
		}
	}
	// Ask to run again while a node is left to follow, whatever else wakes
	// the run; the first enqueue made during a claimed run sets its next
	// due time.
	if left := running + pendLeft; left > 0 {
		if _, err := queue.Enqueue(ctx, tx, Reconciler, runID, requeue); err != nil {
			return fmt.Errorf("requeue run %s: %w", runID, err)
		}
	}
	if len(started) > 0 && wake != nil {
		reconcile.AfterCommit(ctx, func() {
			for _, n := range started {
				wake.Created(n)
			}
		})
	}
	return nil
}

// startNodes starts up to n pending nodes of the run in node id order: the
// commands are inserted in one statement (cmdstore.InsertMany) and the
// run_nodes marked running in another, both in tx, whatever n is.
func startNodes(ctx context.Context, tx pgx.Tx, runID string, n int, cmd cmdstore.Command) ([]string, error) {
	rows, err := tx.Query(ctx, pendingSQL, runID, n)
	if err != nil {
		return nil, fmt.Errorf("read pending nodes of run %s: %w", runID, err)
	}
	nodes, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("read pending nodes of run %s: %w", runID, err)
	}
	cmds := make([]cmdstore.Command, len(nodes))
	for i, node := range nodes {
		cmds[i] = cmd
		cmds[i].NodeID, cmds[i].IdempotencyKey = node, CommandKey(runID, node)
	}
	in, refused, err := cmdstore.InsertMany(ctx, tx, cmds)
	if err != nil {
		return nil, fmt.Errorf("start nodes of run %s: %w", runID, err)
	}
	started := make([]string, 0, len(nodes))
	ids := make([]string, 0, len(nodes))
	for i, node := range nodes {
		if refused[i] != nil {
			if _, err := tx.Exec(ctx, skipSQL, runID, node, "node revoked before it started"); err != nil {
				return nil, fmt.Errorf("skip node %s of run %s: %w", node, runID, err)
			}
			continue
		}
		started, ids = append(started, node), append(ids, in[i].ID)
	}
	if len(started) > 0 {
		if _, err := tx.Exec(ctx, startSQL, runID, started, ids); err != nil {
			return nil, fmt.Errorf("mark %d nodes of run %s running: %w", len(started), runID, err)
		}
	}
	return started, nil
}
