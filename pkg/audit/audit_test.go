package audit_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/audit"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestRecordManyWritesWhatRecordWrites: events written together read back
// as events written one by one do, and an event whose detail does not
// encode writes none of its group.
func TestRecordManyWritesWhatRecordWrites(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	ev := func(id string) audit.Event {
		return audit.Event{Actor: "op", Role: "operator", Method: "CreateCommand", TargetKind: "command", TargetID: id,
			Detail: map[string]any{"node_id": "n-1"}}
	}
	require.NoError(t, audit.Record(ctx, db, ev("c-1")))
	require.NoError(t, audit.RecordMany(ctx, db, []audit.Event{ev("c-2"), ev("c-3")}))
	require.NoError(t, audit.RecordMany(ctx, db, nil))

	rows, err := db.Query(ctx, `SELECT actor, role, method, target_kind, target_id, outcome, detail->>'node_id' FROM audit_events ORDER BY target_id`)
	require.NoError(t, err)
	var got [][]string
	for rows.Next() {
		r := make([]string, 7)
		require.NoError(t, rows.Scan(&r[0], &r[1], &r[2], &r[3], &r[4], &r[5], &r[6]))
		got = append(got, r)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, [][]string{
		{"op", "operator", "CreateCommand", "command", "c-1", "ok", "n-1"},
		{"op", "operator", "CreateCommand", "command", "c-2", "ok", "n-1"},
		{"op", "operator", "CreateCommand", "command", "c-3", "ok", "n-1"},
	}, got)

	bad := ev("c-4")
	bad.Detail = map[string]any{"x": make(chan int)}
	require.ErrorContains(t, audit.RecordMany(ctx, db, []audit.Event{ev("c-5"), bad}), "encode detail")
	var n int
	require.NoError(t, db.QueryRow(ctx, `SELECT count(*) FROM audit_events`).Scan(&n))
	require.Equal(t, 3, n, "nothing of the group was written")
}
