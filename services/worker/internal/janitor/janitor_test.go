package janitor_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/services/worker/internal/janitor"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestJanitorTrimsAgedRowsAndKeepsUndeliveredEvents(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	_, err := db.Exec(ctx, `
INSERT INTO workers (id, heartbeat_at) VALUES ('old', compute_now() - interval '11 minutes'), ('live', compute_now());
INSERT INTO nodes (id) VALUES ('n1');
INSERT INTO commands (id, node_id, kind, state, finished_at) VALUES
  ('old-done', 'n1', 'k', 'succeeded', compute_now() - interval '8 days'),
  ('new-done', 'n1', 'k', 'succeeded', compute_now()),
  ('old-pending', 'n1', 'k', 'pending', NULL);
INSERT INTO command_results (node_id, id, command_id, exit_code, gateway_id, session_epoch) VALUES ('n1', 'r1', 'old-done', 0, 'gw', 1);
INSERT INTO node_events (node_id, id, kind, received_at, gateway_id, session_epoch) VALUES
  ('n1', 'e-old-1', 'k', compute_now() - interval '8 days', 'gw', 1),
  ('n1', 'e-new', 'k', compute_now(), 'gw', 1);
INSERT INTO node_events (node_id, id, kind, received_at, gateway_id, session_epoch) VALUES
  ('n1', 'e-old-2', 'k', compute_now() - interval '8 days', 'gw', 1);`)
	require.NoError(t, err)
	// A sink that has delivered e-old-1 but not e-old-2 (a later transaction).
	_, err = db.Exec(ctx, `
INSERT INTO sinks (id, url, secret) VALUES ('s1', 'http://127.0.0.1:1/', 'abcdefghijklmnop');
INSERT INTO sink_cursors (sink_id, cursor_txid, cursor)
  SELECT 's1', txid::text::bigint, seq FROM node_events WHERE id = 'e-old-1'`)
	require.NoError(t, err)

	var c janitor.Counts
	require.NoError(t, pgdb.InTx(ctx, db, func(tx pgx.Tx) error {
		var err error
		c, err = janitor.Run(ctx, tx, janitor.DefaultConfig())
		return err
	}))
	require.Equal(t, janitor.Counts{Workers: 1, Commands: 1, Events: 1}, c)
	ids := func(sql string) []string {
		rows, err := db.Query(ctx, sql)
		require.NoError(t, err)
		out, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return out
	}
	require.Equal(t, []string{"live"}, ids("SELECT id FROM workers ORDER BY id"))
	require.Equal(t, []string{"new-done", "old-pending"}, ids("SELECT id FROM commands ORDER BY id"))
	require.Empty(t, ids("SELECT id FROM command_results"), "results went with their command")
	require.Equal(t, []string{"e-new", "e-old-2"}, ids("SELECT id FROM node_events ORDER BY id"), "an undelivered event is kept past retention")
}

// TestJanitorTrimsAuditEventsPastRetentionInBatches: rows older than the
// audit retention go, the oldest first and at most a batch per run; newer
// rows stay.
func TestJanitorTrimsAuditEventsPastRetentionInBatches(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	_, err := db.Exec(ctx, `
INSERT INTO audit_events (actor, role, method, target_kind, target_id, outcome, at)
SELECT 'a', 'admin', 'CreatePool', 'pool', 'old-' || i, 'ok', compute_now() - interval '91 days' - make_interval(mins => i)
  FROM generate_series(1, 5) i;
INSERT INTO audit_events (actor, role, method, target_kind, target_id, outcome, at) VALUES
  ('a', 'admin', 'CreatePool', 'pool', 'recent', 'ok', compute_now() - interval '89 days'),
  ('a', 'admin', 'CreatePool', 'pool', 'now', 'ok', compute_now())`)
	require.NoError(t, err)
	cfg := janitor.DefaultConfig()
	cfg.Batch = 2
	run := func() janitor.Counts {
		var c janitor.Counts
		require.NoError(t, pgdb.InTx(ctx, db, func(tx pgx.Tx) error {
			var err error
			c, err = janitor.Run(ctx, tx, cfg)
			return err
		}))
		return c
	}
	targets := func() []string {
		rows, err := db.Query(ctx, `SELECT target_id FROM audit_events ORDER BY target_id`)
		require.NoError(t, err)
		out, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return out
	}
	require.EqualValues(t, 2, run().Audit)
	require.Equal(t, []string{"now", "old-1", "old-2", "old-3", "recent"}, targets(), "the two oldest went first")
	require.EqualValues(t, 2, run().Audit)
	require.EqualValues(t, 1, run().Audit)
	require.Zero(t, run().Audit)
	require.Equal(t, []string{"now", "recent"}, targets())

	cfg.AuditRetention = time.Minute
	require.Error(t, cfg.Validate())
}

// TestJanitorTrimsOldCommandOutput: the live output of a command finished
// longer ago than the output retention goes, the command stays; output of
// a recent or running command stays.
func TestJanitorTrimsOldCommandOutput(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	_, err := db.Exec(ctx, `
INSERT INTO nodes (id) VALUES ('n1');
INSERT INTO commands (id, node_id, kind, state, finished_at) VALUES
  ('old', 'n1', 'k', 'succeeded', compute_now() - interval '25 hours'),
  ('recent', 'n1', 'k', 'failed', compute_now() - interval '1 hour'),
  ('running', 'n1', 'k', 'acknowledged', NULL);
INSERT INTO command_output (command_id, "offset", stream, data) VALUES
  ('old', 0, 'stdout', 'ab'), ('old', 2, 'stderr', 'cd'), ('old', 4, 'truncated', ''),
  ('recent', 0, 'stdout', 'x'), ('running', 0, 'stdout', 'y');`)
	require.NoError(t, err)
	var c janitor.Counts
	require.NoError(t, pgdb.InTx(ctx, db, func(tx pgx.Tx) error {
		var err error
		c, err = janitor.Run(ctx, tx, janitor.DefaultConfig())
		return err
	}))
	require.EqualValues(t, 3, c.Output)
	require.Zero(t, c.Commands)
	rows, err := db.Query(ctx, `SELECT command_id FROM command_output ORDER BY command_id`)
	require.NoError(t, err)
	left, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"recent", "running"}, left)
}

func TestJanitorTrimsOldRuns(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	_, err := db.Exec(ctx, `
INSERT INTO nodes (id) VALUES ('n1');
INSERT INTO runs (id, target, kind, command_timeout, max_in_flight, max_failures, state, finished_at) VALUES
  ('old', '{}', 'k', interval '1 hour', 1, 0, 'succeeded', compute_now() - interval '8 days'),
  ('recent', '{}', 'k', interval '1 hour', 1, 0, 'failed', compute_now() - interval '1 hour'),
  ('running', '{}', 'k', interval '1 hour', 1, 0, 'running', NULL);
INSERT INTO run_nodes (run_id, node_id) VALUES ('old', 'n1'), ('recent', 'n1'), ('running', 'n1');`)
	require.NoError(t, err)
	var c janitor.Counts
	require.NoError(t, pgdb.InTx(ctx, db, func(tx pgx.Tx) error {
		var err error
		c, err = janitor.Run(ctx, tx, janitor.DefaultConfig())
		return err
	}))
	require.EqualValues(t, 1, c.Runs)
	rows, err := db.Query(ctx, `SELECT run_id FROM run_nodes ORDER BY run_id`)
	require.NoError(t, err)
	left, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"recent", "running"}, left, "a run's nodes go with it")
}
