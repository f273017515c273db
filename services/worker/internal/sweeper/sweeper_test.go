package sweeper_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/services/worker/internal/sweeper"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestSweepExpiresAndRequeues(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	_, err := db.Exec(ctx, `
INSERT INTO nodes (id) VALUES ('n1');
INSERT INTO commands (id, node_id, kind, state, deadline, dispatched_at) VALUES
  ('past-deadline', 'n1', 'reboot', 'dispatched', compute_now() - interval '1 second', compute_now()),
  ('unacked',       'n1', 'reboot', 'dispatched', compute_now() + interval '1 hour', compute_now() - interval '31 seconds'),
  ('fresh',         'n1', 'reboot', 'dispatched', compute_now() + interval '1 hour', compute_now()),
  ('acked',         'n1', 'reboot', 'acknowledged', compute_now() + interval '1 hour', compute_now() - interval '1 hour'),
  ('done',          'n1', 'reboot', 'succeeded', compute_now() - interval '1 hour', compute_now() - interval '1 hour');
-- An ack as this release's gateway writes it: acked_at, the state unchanged.
INSERT INTO commands (id, node_id, kind, state, deadline, dispatched_at, acked_at) VALUES
  ('acked-at',      'n1', 'reboot', 'dispatched', compute_now() + interval '1 hour', compute_now() - interval '1 hour', compute_now())`)
	require.NoError(t, err)
	var expired, requeued int64
	require.NoError(t, pgdb.InTx(ctx, db, func(tx pgx.Tx) error {
		var err error
		expired, requeued, err = sweeper.Sweep(ctx, tx, sweeper.Config{Every: time.Second, AckTimeout: 30 * time.Second})
		return err
	}))
	require.EqualValues(t, 1, expired)
	require.EqualValues(t, 1, requeued)
	states := map[string]string{}
	rows, err := db.Query(ctx, "SELECT id, state FROM commands")
	require.NoError(t, err)
	for rows.Next() {
		var id, st string
		require.NoError(t, rows.Scan(&id, &st))
		states[id] = st
	}
	require.Equal(t, map[string]string{"past-deadline": "expired", "unacked": "pending", "fresh": "dispatched",
		"acked": "acknowledged", "acked-at": "dispatched", "done": "succeeded"}, states)
}
