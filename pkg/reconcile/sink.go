package reconcile

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leasehold/leasehold/pkg/coord"
)

// Cursor is a sink's position: records are read in (TxID, Seq) order, so a
// cursor never passes a record that commits later (see migration 00012).
// Sinks over a plain sequence leave TxID at 0.
type Cursor struct {
	TxID int64
	Seq  int64
}

// Sink delivers records past a cursor, in batches, somewhere outside the
// database (a webhook, say).
type Sink struct {
	// ID names the sink; its lease is singleton:sink:<ID>.
	ID string
	// Fetch reads up to limit records after cursor and returns them with the
	// cursor of the last one.
	Fetch func(ctx context.Context, db *pgxpool.Pool, cursor Cursor, limit int) (batch any, next Cursor, n int, err error)
	// Deliver sends one batch; it is retried with back-off while the lease
	// is held.
	Deliver func(ctx context.Context, batch any) error
	// Limit is the batch size (default 100).
	Limit int
	// Idle is how long to wait when there is nothing to deliver (default 1 s).
	Idle time.Duration
}

// RegisterSink adds a sink-style singleton: while this process holds
// singleton:sink:<ID> it fetches from the saved cursor, delivers, and saves
// the new cursor in a transaction fenced on the lease after every delivered
// batch. A new epoch resumes from the last saved cursor, so a batch
// delivered just before a takeover may be delivered again: at-least-once.
func (rt *Runtime) RegisterSink(s Sink) error {
	if s.Fetch == nil || s.Deliver == nil {
		return fmt.Errorf("sink %s: needs Fetch and Deliver", s.ID)
	}
	if s.Limit <= 0 {
		s.Limit = 100
	}
	if s.Idle <= 0 {
		s.Idle = time.Second
	}
	return rt.RegisterJob(Job{Name: "sink:" + s.ID, Run: func(ctx context.Context, jc *JobContext) error {
		return rt.runSink(ctx, jc, s)
	}})
}

func (rt *Runtime) runSink(ctx context.Context, jc *JobContext, s Sink) error {
	var cursor Cursor
	err := rt.db.QueryRow(ctx, "SELECT cursor_txid, cursor FROM sink_cursors WHERE sink_id = $1", s.ID).Scan(&cursor.TxID, &cursor.Seq)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("read cursor of sink %s: %w", s.ID, err)
	}
	rt.logger.Info("sink resuming", "sink", s.ID, "cursor", cursor, "epoch", jc.Lease.Epoch)
	failures := 0
	for {
		if _, err := jc.Current(); err != nil {
			return err
		}
		batch, next, n, err := s.Fetch(ctx, rt.db, cursor, s.Limit)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			rt.logger.Warn("sink fetch failed", "sink", s.ID, "err", err)
			if !rt.sleep(ctx, s.Idle) {
				return nil
			}
			continue
		}
		if n == 0 {
			if !rt.sleep(ctx, s.Idle) {
				return nil
			}
			continue
		}
		if err := s.Deliver(ctx, batch); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			failures++
			rt.m.sinkBatches.WithLabelValues(s.ID, "error").Inc()
			wait := rt.cfg.Backoff.Delay(failures)
			rt.logger.Warn("sink delivery failed; retrying", "sink", s.ID, "cursor", cursor, "attempt", failures, "retry_in", wait, "err", err)
			if !rt.sleep(ctx, wait) {
				return nil
			}
			continue
		}
		failures = 0
		rt.m.sinkBatches.WithLabelValues(s.ID, "ok").Inc()
		err = jc.RunFenced(ctx, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `
INSERT INTO sink_cursors (sink_id, cursor_txid, cursor, lease_epoch, updated_at) VALUES ($1, $2, $3, $4, compute_now())
ON CONFLICT (sink_id) DO UPDATE SET cursor_txid = EXCLUDED.cursor_txid, cursor = EXCLUDED.cursor,
  lease_epoch = EXCLUDED.lease_epoch, updated_at = EXCLUDED.updated_at`,
				s.ID, next.TxID, next.Seq, jc.Lease.Epoch)
			return err
		})
		if errors.Is(err, coord.ErrLeaseLost) {
			return err // the new holder re-delivers from the saved cursor
		}
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			rt.logger.Warn("sink cursor save failed; the batch will be delivered again", "sink", s.ID, "err", err)
			continue
		}
		cursor = next
	}
}

func (rt *Runtime) sleep(ctx context.Context, d time.Duration) bool {
	select {
	case <-ctx.Done():
		return false
	case <-rt.clock.After(d):
		return true
	}
}
