package doctor

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// stuckSQL finds leases past their expiry whose row is locked by a running
// transaction. A row lock lives in the tuple, not in pg_locks: the fence's
// FOR KEY SHARE (pkg/coord.Fence) writes the locker's transaction id into
// the row's xmax, and every running transaction holds an ExclusiveLock on
// its own id, so the join names the locker. (Several concurrent fenced
// lockers share a multixact instead; longFencedSQL still sees them.)
const stuckSQL = `
SELECT l.name, coalesce(l.owner, ''), l.epoch, compute_now() - l.expires_at,
       lk.pid, coalesce(a.application_name, ''), coalesce(a.state, ''),
       compute_now() - a.xact_start, coalesce(a.usename::text, '')
  FROM leases l
  JOIN pg_locks lk ON lk.locktype = 'transactionid' AND lk.transactionid = l.xmax
                  AND lk.mode = 'ExclusiveLock' AND lk.granted
  LEFT JOIN pg_stat_activity a ON a.pid = lk.pid
 WHERE l.owner IS NOT NULL AND isfinite(l.expires_at) AND l.expires_at < compute_now()
 ORDER BY l.expires_at`

// longFencedSQL lists the transactions holding a row lock (RowShareLock:
// SELECT ... FOR KEY SHARE, the fence, or any other FOR ... locking clause)
// on the leases table of this database.
const longFencedSQL = `
SELECT lk.pid, coalesce(a.application_name, ''), coalesce(a.state, ''),
       compute_now() - a.xact_start, coalesce(a.usename::text, ''), coalesce(left(a.query, 160), '')
  FROM pg_locks lk
  LEFT JOIN pg_stat_activity a ON a.pid = lk.pid
 WHERE lk.locktype = 'relation' AND lk.relation = 'leases'::regclass
   AND lk.database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND lk.mode = 'RowShareLock' AND lk.granted AND lk.pid <> pg_backend_pid()
 ORDER BY a.xact_start NULLS LAST`

const seeStatsSQL = `SELECT pg_has_role('pg_read_all_stats', 'USAGE')`

type lockHolder struct {
	pid                     int32
	app, state, user, query string
	xactAge                 *time.Duration
}

func (h lockHolder) String() string {
	age := "hidden"
	if h.xactAge != nil {
		age = dur(*h.xactAge)
	}
	s := fmt.Sprintf("pid %d", h.pid)
	if h.app != "" {
		s += " " + h.app
	}
	if h.user != "" {
		s += " user " + h.user
	}
	if h.state != "" {
		s += " " + h.state
	}
	return s + " transaction age " + age
}

func checkStuck(ctx context.Context, d *Doctor) (Finding, error) {
	type stuck struct {
		name, owner string
		epoch       int64
		overdue     time.Duration
		holder      lockHolder
	}
	var stuckRows []stuck
	var holders []lockHolder
	var canSee bool
	err := d.read(ctx, func(tx pgx.Tx) error {
		r, err := tx.Query(ctx, stuckSQL)
		if err != nil {
			return err
		}
		if stuckRows, err = pgx.CollectRows(r, func(r pgx.CollectableRow) (stuck, error) {
			var s stuck
			return s, r.Scan(&s.name, &s.owner, &s.epoch, &s.overdue, &s.holder.pid, &s.holder.app, &s.holder.state, &s.holder.xactAge, &s.holder.user)
		}); err != nil {
			return err
		}
		r, err = tx.Query(ctx, longFencedSQL)
		if err != nil {
			return err
		}
		if holders, err = pgx.CollectRows(r, func(r pgx.CollectableRow) (lockHolder, error) {
			var h lockHolder
			return h, r.Scan(&h.pid, &h.app, &h.state, &h.xactAge, &h.user, &h.query)
		}); err != nil {
			return err
		}
		return tx.QueryRow(ctx, seeStatsSQL).Scan(&canSee)
	})
	if err != nil {
		return Finding{}, err
	}
	stuckPids := map[int32]bool{}
	for _, s := range stuckRows {
		stuckPids[s.holder.pid] = true
	}
	var long []lockHolder
	hidden := 0
	for _, h := range holders {
		switch {
		case stuckPids[h.pid]:
		case h.xactAge == nil:
			hidden++
		case *h.xactAge > d.cfg.LeaseTTL:
			long = append(long, h)
		}
	}
	const terminate = "SELECT pg_terminate_backend(<pid>)"
	addLong := func(f *Finding) {
		capped(f, "long_fenced_transaction", long, func(h lockHolder) string {
			s := h.String()
			if h.query != "" {
				s += fmt.Sprintf(" last statement %q", strings.Join(strings.Fields(h.query), " "))
			}
			return s
		})
	}
	if len(stuckRows) > 0 {
		first := stuckRows[0]
		f := critical(fmt.Sprintf("%s held past expiry by an open transaction: %s expired %s ago, still locked by pid %d; a successor's takeover waits for it",
			plural(len(stuckRows), "lease", "leases"), first.name, dur(first.overdue), first.holder.pid),
			"the holder's transaction is still open (a paused or wedged process, or an idle-in-transaction session): stop or resume that process, "+
				"or as an administrator run "+terminate+"; fenced transactions need a statement_timeout and the role an idle_in_transaction_session_timeout (docs/design.md#fencing)")
		capped(&f, "stuck_lease", stuckRows, func(s stuck) string {
			return fmt.Sprintf("%s owner %s epoch %d expired %s ago, locked by %s", s.name, s.owner, s.epoch, dur(s.overdue), s.holder)
		})
		addLong(&f)
		return f, nil
	}
	if len(long) > 0 {
		f := warn(fmt.Sprintf("%s held FOR KEY SHARE locks on leases longer than the lease TTL %s (oldest pid %d, %s)",
			plural(len(long), "transaction has", "transactions have"), dur(d.cfg.LeaseTTL), long[0].pid, dur(*long[0].xactAge)),
			"a fenced transaction that outlives its lease's TTL holds off the renewal and any takeover of that lease: "+
				"find what the process is waiting on, shorten the transaction, or end it with "+terminate)
		addLong(&f)
		return f, nil
	}
	if hidden > 0 && !canSee {
		return unchecked(fmt.Sprintf("%s hold locks on leases but their ages are hidden from this role", plural(hidden, "transaction", "transactions")),
			"grant the doctor's role pg_read_all_stats (or pg_monitor) so it can see other roles' transaction ages"), nil
	}
	f := ok(fmt.Sprintf("no lease is held past its expiry and no fenced transaction is older than %s", dur(d.cfg.LeaseTTL)))
	f.add("fenced_transactions", "%d open", len(holders))
	return f, nil
}
