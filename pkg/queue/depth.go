package queue

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// OverdueAfter is how long a claimable key may wait before Depth counts it
// as overdue: the queue is not keeping up, or no worker holds its shard.
const OverdueAfter = 5 * time.Minute

// QueueStats describes one reconciler's queue.
type QueueStats struct {
	// Total counts every queued key.
	Total int64
	// Due counts keys claimable now: unclaimed and due, or with an expired claim.
	Due int64
	// Claimed counts keys under a live claim (being run).
	Claimed int64
	// ExpiredClaims counts claims past their end: a worker died or stalled.
	// They are included in Due.
	ExpiredClaims int64
	// Overdue counts claimable keys that have waited longer than OverdueAfter.
	Overdue int64
	// OldestDue is how long the longest-waiting claimable key has waited
	// (0 when none is due).
	OldestDue time.Duration
}

// The "waiting since" of a key is LEAST(due_at, claimed_until): due_at for an
// unclaimed key, the claim's end for an expired one (see claimSQL).
const depthSQL = `
WITH c AS (SELECT compute_now() AS now),
q AS (
  SELECT w.reconciler, w.claimed_until, c.now,
         CASE WHEN (w.claimed_until IS NULL OR w.claimed_until < c.now)
               AND LEAST(w.due_at, w.claimed_until) <= c.now
              THEN LEAST(w.due_at, w.claimed_until) END AS waiting_since
    FROM work_queue w, c
)
SELECT reconciler,
       count(*),
       count(waiting_since),
       count(*) FILTER (WHERE claimed_until >= now),
       count(*) FILTER (WHERE claimed_until < now),
       count(*) FILTER (WHERE waiting_since < now - make_interval(secs => $1::float8)),
       COALESCE(EXTRACT(EPOCH FROM max(now - waiting_since)), 0)::float8
  FROM q
 GROUP BY reconciler`

// Depth returns per-reconciler queue statistics, for the queue depth gauge
// and doctor. It scans the whole table; call it on a metrics interval, not
// per claim.
func Depth(ctx context.Context, db Querier) (map[string]QueueStats, error) {
	rows, err := db.Query(ctx, depthSQL, OverdueAfter.Seconds())
	if err != nil {
		return nil, fmt.Errorf("work queue depth: %w", err)
	}
	out := map[string]QueueStats{}
	var (
		name   string
		s      QueueStats
		oldest float64
	)
	_, err = pgx.ForEachRow(rows, []any{&name, &s.Total, &s.Due, &s.Claimed, &s.ExpiredClaims, &s.Overdue, &oldest}, func() error {
		s.OldestDue = time.Duration(oldest * float64(time.Second)).Round(time.Millisecond)
		out[name] = s
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("work queue depth: %w", err)
	}
	return out, nil
}
