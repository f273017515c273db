package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/daemon"
	"github.com/leasehold/leasehold/pkg/faultproxy"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgdb"
)

// nodeFleet is a set of in-process node daemons behind an L4 balancer that
// count every execution of every command, so a test can prove each command
// ran exactly once per node.
type nodeFleet struct {
	mu         sync.Mutex
	executions map[string]int // command id -> executions
	daemons    []*daemon.Daemon
	cancel     context.CancelFunc
	wg         sync.WaitGroup
}

func startNodes(t *testing.T, address string, ids, creds []string) *nodeFleet {
	t.Helper()
	return startNodesBackoff(t, address, ids, creds, 100*time.Millisecond, time.Second)
}

// startNodesBackoff is startNodes with the daemons' redial back-off bounds
// (the defaults are 1 s and 60 s).
func startNodesBackoff(t *testing.T, address string, ids, creds []string, base, limit time.Duration) *nodeFleet {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	f := &nodeFleet{executions: map[string]int{}, cancel: cancel}
	for i := range ids {
		d, err := daemon.New(daemon.Config{
			Address: address, NodeID: ids[i], Credential: creds[i],
			BackoffBase: base, BackoffMax: limit,
			Handler: func(ctx context.Context, c *nodev1.Command) daemon.Outcome {
				f.mu.Lock()
				f.executions[c.GetCommandId()]++
				f.mu.Unlock()
				select {
				case <-time.After(time.Duration(10+rand.IntN(90)) * time.Millisecond):
				case <-ctx.Done():
				}
				return daemon.Outcome{Output: []byte("ok")}
			},
		})
		require.NoError(t, err)
		f.daemons = append(f.daemons, d)
		f.wg.Add(1)
		go func() { defer f.wg.Done(); _ = d.Run(ctx) }()
	}
	t.Cleanup(f.stop)
	return f
}

func (f *nodeFleet) stop() { f.cancel(); f.wg.Wait() }

// twice returns the commands executed more than once, and how many distinct
// commands executed.
func (f *nodeFleet) twice() (dup []string, distinct int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for id, n := range f.executions {
		if n > 1 {
			dup = append(dup, fmt.Sprintf("%s×%d", id, n))
		}
	}
	return dup, len(f.executions)
}

func (f *nodeFleet) executed(id string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.executions[id]
}

// commandLoad inserts one command every interval for a random node, with a
// client-chosen id, until stopped. An INSERT that failed (the database was
// down) may or may not have committed: its id is kept as "maybe" and
// resolved against the table at the end.
type commandLoad struct {
	db    *pgxpool.Pool
	ids   []string
	seq   atomic.Int64
	mu    sync.Mutex
	ok    []string
	maybe []string
	stopC chan struct{}
	wg    sync.WaitGroup
}

func startLoad(t *testing.T, db *pgxpool.Pool, prefix string, nodes []string, every time.Duration) *commandLoad {
	l := &commandLoad{db: db, ids: nodes, stopC: make(chan struct{})}
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		for {
			select {
			case <-l.stopC:
				return
			case <-time.After(every):
			}
			id := fmt.Sprintf("%s-%d", prefix, l.seq.Add(1))
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			// An acknowledged insert must survive a crash of the server: commit
			// synchronously even on the test cluster (which turns
			// synchronous_commit off for speed).
			err := pgdb.InTx(ctx, l.db, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, `SET LOCAL synchronous_commit = on`); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, `INSERT INTO commands (id, node_id, kind) VALUES ($1, $2, 'exec')`, id, nodes[rand.IntN(len(nodes))])
				return err
			})
			cancel()
			l.mu.Lock()
			if err == nil {
				l.ok = append(l.ok, id)
			} else {
				l.maybe = append(l.maybe, id)
			}
			l.mu.Unlock()
		}
	}()
	t.Cleanup(l.stop)
	return l
}

// acknowledged returns the ids whose insert has committed so far.
func (l *commandLoad) acknowledged() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.ok...)
}

func (l *commandLoad) stop() {
	select {
	case <-l.stopC:
	default:
		close(l.stopC)
	}
	l.wg.Wait()
}

// created returns every command id that exists: acknowledged inserts plus
// the failed ones that committed after all.
func (l *commandLoad) created(t *testing.T) (ids []string, acked, failed int) {
	t.Helper()
	l.stop()
	l.mu.Lock()
	defer l.mu.Unlock()
	ids = append(ids, l.ok...)
	if len(l.maybe) > 0 {
		var found []string
		require.NoError(t, pgxRetry(func() error {
			rows, err := l.db.Query(context.Background(), `SELECT id FROM commands WHERE id = ANY($1)`, l.maybe)
			if err != nil {
				return err
			}
			found = found[:0]
			for rows.Next() {
				var id string
				if err := rows.Scan(&id); err != nil {
					return err
				}
				found = append(found, id)
			}
			return rows.Err()
		}))
		ids = append(ids, found...)
	}
	return ids, len(l.ok), len(l.maybe)
}

// pgxRetry retries fn for up to 30 s: right after a database fault the
// first attempts may meet broken connections.
func pgxRetry(fn func() error) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := fn()
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(100 * time.Millisecond) // poll interval of a loop bounded by its deadline
	}
}

func queryInt(db *pgxpool.Pool, sql string, args ...any) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var n int
	err := db.QueryRow(ctx, sql, args...).Scan(&n)
	return n, err
}

// leaseEpochs maps lease name to (owner, epoch).
type leaseRow struct {
	owner   string
	epoch   int64
	expires time.Time
}

func readLeases(t *testing.T, db *pgxpool.Pool) map[string]leaseRow {
	t.Helper()
	out := map[string]leaseRow{}
	require.NoError(t, pgxRetry(func() error {
		rows, err := db.Query(context.Background(), `SELECT name, coalesce(owner, ''), epoch, greatest(expires_at, 'epoch') FROM leases`)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var r leaseRow
			var name string
			if err := rows.Scan(&name, &r.owner, &r.epoch, &r.expires); err != nil {
				return err
			}
			out[name] = r
		}
		return rows.Err()
	}))
	return out
}

// balancer is an L4 balancer in front of the gateways.
func balancer(t *testing.T, backends ...string) *faultproxy.Proxy {
	t.Helper()
	lb, err := faultproxy.NewBalancer(backends...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = lb.Close() })
	return lb
}

// waitCompleted waits until every command in ids has succeeded; on timeout
// it fails with what the stragglers look like.
func waitCompleted(t *testing.T, db *pgxpool.Pool, nodes *nodeFleet, ids []string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		n, err := queryInt(db, `SELECT count(*) FROM commands WHERE state = 'succeeded' AND id = ANY($1)`, ids)
		if err == nil && n == len(ids) {
			return
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond) // poll interval of a loop bounded by its deadline
	}
	rows, err := db.Query(context.Background(), `
SELECT c.id, c.node_id, c.state, c.dispatch_count, coalesce(c.dispatched_by, ''), coalesce(c.dispatch_epoch, 0),
       coalesce(s.gateway_id, ''), coalesce(s.session_epoch, 0), coalesce(s.state, ''),
       (SELECT count(*) FROM command_results_all r WHERE r.command_id = c.id)
  FROM commands c LEFT JOIN node_sessions s ON s.node_id = c.node_id
 WHERE c.id = ANY($1) AND c.state <> 'succeeded' ORDER BY c.id LIMIT 20`, ids)
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var id, node, state, by, gw, sstate string
		var count, epoch, sepoch, results int64
		require.NoError(t, rows.Scan(&id, &node, &state, &count, &by, &epoch, &gw, &sepoch, &sstate, &results))
		t.Logf("straggler %s node=%s state=%s dispatches=%d by=%s@%d session=%s@%d/%s results=%d executed=%d",
			id, node, state, count, by, epoch, gw, sepoch, sstate, results, nodes.executed(id))
	}
	missing, err := queryInt(db, `SELECT $2::int - count(*) FROM commands WHERE id = ANY($1)`, ids, len(ids))
	require.NoError(t, err)
	t.Fatalf("not every created command completed within %s (%d of them no longer exist)", within, missing)
}
