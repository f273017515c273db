package gateway

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
)

// TestGroupCommitRetriesALockConflictWhole: when the database aborts a
// group commit for a lock conflict (here a trigger raises
// deadlock_detected the first time a command turns terminal, as a Hello's
// replay locking the same rows in another order would), the gateway writes
// the same batch again, whole, instead of one statement per report; the
// results are stored once and answered.
func TestGroupCommitRetriesALockConflictWhole(t *testing.T) {
	t.Parallel()
	db, g, s := oneNodeSession(t, testConfig())
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `
CREATE SEQUENCE conflict_once;
CREATE FUNCTION conflict_once() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  -- nextval is not rolled back with the aborted statement: it fires once.
  IF NEW.state IN ('succeeded', 'failed') AND OLD.state NOT IN ('succeeded', 'failed') AND nextval('conflict_once') = 1 THEN
    RAISE EXCEPTION 'injected lock conflict' USING ERRCODE = '40P01';
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER conflict_once BEFORE UPDATE ON commands FOR EACH ROW EXECUTE FUNCTION conflict_once()`)
	require.NoError(t, err)

	a, b := insertCommand(t, db, "n-0", "t"), insertCommand(t, db, "n-0", "t")
	got := []string{recvCommand(t, s), recvCommand(t, s)}
	require.ElementsMatch(t, []string{a, b}, got)
	sendResult(t, s, a)
	sendResult(t, s, b)
	s.sync(t, 7) // acked once every result before it is stored
	require.Equal(t, map[string]int{"succeeded": 2}, commandStates(t, db, "n-0"))
	require.InDelta(t, 1, testutil.ToFloat64(g.m.ingestRetries), 0, "the conflict was retried once")
	var fired int64
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT last_value FROM conflict_once`).Scan(&fired))
	require.GreaterOrEqual(t, fired, int64(2), "the retry went through the trigger again")
}
