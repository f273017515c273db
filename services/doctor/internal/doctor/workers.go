package doctor

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/pkg/coord"
)

// A key has been waiting since LEAST(due_at, claimed_until) when it is not
// under a live claim: due_at for an unclaimed key, the claim's end for one
// whose claim expired (pkg/queue's claim order).
const overdueSQL = `
WITH c AS (SELECT compute_now() AS now)
SELECT q.reconciler, q.key, q.shard, q.attempts, coalesce(q.last_error, ''), coalesce(q.claimed_by, ''),
       c.now - LEAST(q.due_at, q.claimed_until) AS late
  FROM work_queue q, c
 WHERE (q.claimed_until IS NULL OR q.claimed_until < c.now)
   AND LEAST(q.due_at, q.claimed_until) < c.now - make_interval(secs => $1::float8)
 ORDER BY LEAST(q.due_at, q.claimed_until)
 LIMIT 1000`

const queueTotalsSQL = `
SELECT count(*),
       count(*) FILTER (WHERE (claimed_until IS NULL OR claimed_until < compute_now()) AND LEAST(due_at, claimed_until) <= compute_now()),
       count(*) FILTER (WHERE (claimed_until IS NULL OR claimed_until < compute_now())
                          AND LEAST(due_at, claimed_until) < compute_now() - make_interval(secs => $1::float8))
  FROM work_queue`

const aliveSQL = `
SELECT count(*) FILTER (WHERE heartbeat_at > compute_now() - make_interval(secs => $1::float8)),
       count(*),
       compute_now() - max(heartbeat_at)
  FROM workers`

type overdueKey struct {
	reconciler, key, lastError, claimedBy string
	shard, attempts                       int
	late                                  time.Duration
}

func checkQueue(ctx context.Context, d *Doctor) (Finding, error) {
	var keys []overdueKey
	var total, due, overdue, alive, rows int
	var lastBeat *time.Duration
	err := d.read(ctx, func(tx pgx.Tx) error {
		r, err := tx.Query(ctx, overdueSQL, d.cfg.QueueOverdue.Seconds())
		if err != nil {
			return err
		}
		keys, err = pgx.CollectRows(r, func(r pgx.CollectableRow) (overdueKey, error) {
			var k overdueKey
			return k, r.Scan(&k.reconciler, &k.key, &k.shard, &k.attempts, &k.lastError, &k.claimedBy, &k.late)
		})
		if err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, queueTotalsSQL, d.cfg.QueueOverdue.Seconds()).Scan(&total, &due, &overdue); err != nil {
			return err
		}
		return tx.QueryRow(ctx, aliveSQL, d.cfg.WorkerAlive.Seconds()).Scan(&alive, &rows, &lastBeat)
	})
	if err != nil {
		return Finding{}, err
	}
	if overdue == 0 {
		f := ok(fmt.Sprintf("no work overdue by more than %s (%s queued, %d due now)", dur(d.cfg.QueueOverdue), plural(total, "key", "keys"), due))
		f.add("queued", "%d", total)
		f.add("due_now", "%d", due)
		f.add("workers_alive", "%d", alive)
		return f, nil
	}
	byReconciler := map[string]int{}
	for _, k := range keys {
		byReconciler[k.reconciler]++
	}
	summary := fmt.Sprintf("%s overdue by more than %s (oldest %s late)", plural(overdue, "key", "keys"), dur(d.cfg.QueueOverdue), dur(keys[0].late))
	var f Finding
	if alive == 0 {
		f = critical(summary+" and no worker is alive",
			"start the workers (leasehold-worker, leasehold-scheduler): no worker heartbeated in the last "+dur(d.cfg.WorkerAlive)+
				", so no reconciler runs and nothing new is decided; gateways keep dispatching what is already pending")
	} else {
		f = warn(summary,
			"workers are alive but not draining these keys: check workers.membership and leases.stuck for shards nobody holds, "+
				"and the keys' last_error (a failing key backs off); a worker's logs name the reconciler")
	}
	f.add("overdue", "%d", overdue)
	f.add("queued", "%d", total)
	if alive == 0 {
		if lastBeat != nil {
			f.add("workers_alive", "0 (last heartbeat %s ago, %s)", dur(*lastBeat), plural(rows, "workers row", "workers rows"))
		} else {
			f.add("workers_alive", "0 (no workers rows)")
		}
	} else {
		f.add("workers_alive", "%d", alive)
	}
	names := make([]string, 0, len(byReconciler))
	for n := range byReconciler {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		f.add("reconciler", "%s: %d overdue", n, byReconciler[n])
	}
	capped(&f, "key", keys, func(k overdueKey) string {
		s := fmt.Sprintf("%s/%s shard %d late %s attempts %d", k.reconciler, k.key, k.shard, dur(k.late), k.attempts)
		if k.claimedBy != "" {
			s += " expired claim of " + k.claimedBy
		}
		if k.lastError != "" {
			s += fmt.Sprintf(" last_error %q", truncate(k.lastError, 120))
		}
		return s
	})
	return f, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

const sweeperSQL = `
SELECT period_ms, last_period, completed_by, lease_epoch, compute_now() - completed_at
  FROM singleton_periods WHERE job = $1`

const leaseSQL = `
SELECT coalesce(owner, ''), epoch, expires_at > compute_now(),
       CASE WHEN isfinite(expires_at) THEN expires_at - compute_now() END
  FROM leases WHERE name = $1`

type leaseRow struct {
	owner string
	epoch int64
	live  bool
	// left is expires_at - now (negative once expired); nil when released.
	left *time.Duration
}

// queryLeases reads (key, owner, epoch, live, left) rows of sql into a map.
func queryLeases(ctx context.Context, tx pgx.Tx, sql string) (map[string]leaseRow, error) {
	rows, err := tx.Query(ctx, sql)
	if err != nil {
		return nil, err
	}
	out := map[string]leaseRow{}
	var key string
	var l leaseRow
	_, err = pgx.ForEachRow(rows, []any{&key, &l.owner, &l.epoch, &l.live, &l.left}, func() error {
		out[key] = l
		return nil
	})
	return out, err
}

func (l leaseRow) String() string {
	switch {
	case l.live:
		return fmt.Sprintf("held by %s epoch %d, expires in %s", l.owner, l.epoch, dur(*l.left))
	case l.left == nil:
		return fmt.Sprintf("released (epoch %d)", l.epoch)
	case l.owner == "":
		return fmt.Sprintf("unheld (epoch %d)", l.epoch)
	}
	return fmt.Sprintf("expired %s ago (epoch %d, last owner %s)", dur(-*l.left), l.epoch, l.owner)
}

func readLease(ctx context.Context, tx pgx.Tx, name string) (leaseRow, bool, error) {
	var l leaseRow
	err := tx.QueryRow(ctx, leaseSQL, name).Scan(&l.owner, &l.epoch, &l.live, &l.left)
	if errors.Is(err, pgx.ErrNoRows) {
		return l, false, nil
	}
	return l, err == nil, err
}

func checkSweeper(ctx context.Context, d *Doctor) (Finding, error) {
	job := d.cfg.SweeperJob
	var periodMs, lastPeriod, epoch int64
	var by string
	var age time.Duration
	var found, haveLease bool
	var lease leaseRow
	err := d.read(ctx, func(tx pgx.Tx) error {
		err := tx.QueryRow(ctx, sweeperSQL, job).Scan(&periodMs, &lastPeriod, &by, &epoch, &age)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return err
		}
		found = err == nil
		lease, haveLease, err = readLease(ctx, tx, "singleton:"+job)
		return err
	})
	if err != nil {
		return Finding{}, err
	}
	leaseEvidence := func(f *Finding) {
		if haveLease {
			f.add("lease", "singleton:%s %s", job, lease)
		} else {
			f.add("lease", "singleton:%s never taken", job)
		}
	}
	if !found {
		f := ok(fmt.Sprintf("the %s has not completed a period yet (no singleton_periods row): nothing to judge", job))
		f.add("job", "%s", job)
		leaseEvidence(&f)
		return f, nil
	}
	period := time.Duration(periodMs) * time.Millisecond
	limit := time.Duration(d.cfg.SweeperStalePeriods) * period
	var f Finding
	if age > limit {
		f = warn(fmt.Sprintf("the %s last completed a period %s ago, more than %d periods of %s", job, dur(age), d.cfg.SweeperStalePeriods, dur(period)),
			"check that a worker holds singleton:"+job+" (workers.membership, leases.stuck) and its logs for \"periodic job failed\"; "+
				"periods missed are run in order once a holder resumes")
	} else {
		f = ok(fmt.Sprintf("the %s completed a period %s ago (period %s)", job, dur(age), dur(period)))
	}
	f.add("job", "%s", job)
	f.add("last_completed", "%s ago, period %d by %s at lease epoch %d", dur(age), lastPeriod, by, epoch)
	f.add("period", "%s", dur(period))
	leaseEvidence(&f)
	return f, nil
}

const membersSQL = `
SELECT id, member_group, hostname, leases_held, compute_now() - heartbeat_at, liveness
  FROM workers WHERE member_group = ANY($1::text[]) ORDER BY id`

const shardLeasesSQL = `
SELECT name, coalesce(owner, ''), epoch, expires_at > compute_now(),
       CASE WHEN isfinite(expires_at) THEN expires_at - compute_now() END
  FROM leases WHERE name LIKE 'shard:%' OR name LIKE 'scheduler/shard:%'`

type memberRow struct {
	id, group, hostname string
	leasesHeld          int
	age                 time.Duration
	liveness            bool // keeps a liveness session: a crash is taken over in seconds, not a TTL
}

func checkMembership(ctx context.Context, d *Doctor) (Finding, error) {
	groups := []coord.Group{coord.Controllers, coord.Scheduler}
	var members []memberRow
	var leases map[string]leaseRow
	err := d.read(ctx, func(tx pgx.Tx) error {
		r, err := tx.Query(ctx, membersSQL, []string{coord.Controllers.Name, coord.Scheduler.Name})
		if err != nil {
			return err
		}
		if members, err = pgx.CollectRows(r, func(r pgx.CollectableRow) (memberRow, error) {
			var m memberRow
			return m, r.Scan(&m.id, &m.group, &m.hostname, &m.leasesHeld, &m.age, &m.liveness)
		}); err != nil {
			return err
		}
		leases, err = queryLeases(ctx, tx, shardLeasesSQL)
		return err
	})
	if err != nil {
		return Finding{}, err
	}

	worst := SeverityOK
	var summaries, okParts []string
	var ev []Evidence
	addEv := func(k, format string, args ...any) { ev = append(ev, Evidence{k, fmt.Sprintf(format, args...)}) }
	for _, g := range groups {
		var live []string
		silent := map[string]memberRow{}
		for _, m := range members {
			if m.group != g.Name || m.age > d.cfg.LiveWindow {
				continue
			}
			live = append(live, m.id)
			if m.age > d.cfg.LeaseTTL {
				silent[m.id] = m
			}
		}
		if len(live) == 0 {
			continue
		}
		var sessions, ttlOnly []string
		for _, m := range members {
			if m.group == g.Name && m.age <= d.cfg.LiveWindow {
				if m.liveness {
					sessions = append(sessions, m.id)
				} else {
					ttlOnly = append(ttlOnly, m.id)
				}
			}
		}
		// Which takeover path is in force for a crash of each member.
		addEv(g.Name+".takeover", "liveness session (seconds): %s; TTL path only: %s", listOrNone(sessions), listOrNone(ttlOnly))
		if len(silent) == 0 {
			okParts = append(okParts, fmt.Sprintf("%s: %s live, none silent", g.Name, plural(len(live), "member", "members")))
			addEv(g.Name, "%d live members: %s", len(live), strings.Join(live, ", "))
			continue
		}
		desired := coord.Assign(live)
		// Orphans of each silent member and who holds them now.
		type orphan struct {
			shard int
			lease leaseRow
			has   bool
		}
		orphans := map[string][]orphan{}
		for s, owner := range desired {
			if _, ok := silent[owner]; !ok {
				continue
			}
			l, has := leases[g.ShardLease(s)]
			orphans[owner] = append(orphans[owner], orphan{s, l, has})
		}
		ids := make([]string, 0, len(silent))
		for id := range silent {
			ids = append(ids, id)
		}
		sort.Strings(ids)
		total, takenOver := 0, 0
		for _, id := range ids {
			m := silent[id]
			mine := orphans[id]
			holders := map[string]int{}
			unheld, stillSilent := 0, 0
			for _, o := range mine {
				switch {
				case !o.has || !o.lease.live:
					unheld++
				case g.RowID(o.lease.owner) == id:
					stillSilent++ // the silent member's lease has not expired yet
				default:
					holders[g.RowID(o.lease.owner)]++
				}
			}
			// Orphans nobody holds first: they are the ones not being worked.
			sort.SliceStable(mine, func(i, j int) bool {
				return (!mine[i].has || !mine[i].lease.live) && mine[j].has && mine[j].lease.live
			})
			total += len(mine)
			var hs []string
			for h, n := range holders {
				hs = append(hs, fmt.Sprintf("%s %d", h, n))
				takenOver += n
			}
			sort.Strings(hs)
			addEv("silent_member", "%s (%s) in %s: last heartbeat %s ago, leaves the live set at %s, reported %d leases held",
				id, orDash(m.hostname), g.Name, dur(m.age), dur(d.cfg.LiveWindow), m.leasesHeld)
			desc := fmt.Sprintf("%s: %d orphaned shards: held by other members: %s", id, len(mine), strJoinOr(hs, "none"))
			if stillSilent > 0 {
				desc += fmt.Sprintf(", %d still leased to the silent member", stillSilent)
			}
			if unheld > 0 {
				desc += fmt.Sprintf(", %d unheld", unheld)
			}
			ev = append(ev, Evidence{"orphaned_shards", desc})
			for i, o := range mine {
				if i == maxEvidenceRows {
					addEv("orphan", "… and %d more", len(mine)-maxEvidenceRows)
					break
				}
				if o.has {
					addEv("orphan", "%s %s", g.ShardLease(o.shard), o.lease)
				} else {
					addEv("orphan", "%s never leased", g.ShardLease(o.shard))
				}
			}
		}
		sev := SeverityWarn
		s := fmt.Sprintf("%s: %s of %d silent but still in the live set: %d orphaned shards, %d taken over by other members",
			g.Name, plural(len(silent), "member", "members"), len(live), total, takenOver)
		if len(silent) == len(live) {
			sev = SeverityCritical
			s = fmt.Sprintf("%s: every live member (%d) is silent: no process renews the group's %d shards", g.Name, len(live), coord.NumShards)
		}
		if sev.rank() > worst.rank() {
			worst = sev
		}
		summaries = append(summaries, s)
	}
	if worst == SeverityOK {
		f := ok("no member is silent")
		if len(okParts) > 0 {
			f.Summary = strings.Join(okParts, "; ")
		} else {
			f.Summary = "no live members in the controllers or scheduler groups"
		}
		f.Evidence = ev
		return f, nil
	}
	f := Finding{Severity: worst, Checked: true, Summary: strings.Join(summaries, "; "), Evidence: ev,
		Hint: fmt.Sprintf("a silent member stopped renewing but heartbeated within %s (paused, swapping, partitioned from the database?): "+
			"kill or resume it; survivors take its shards as their leases expire and it leaves the live set at %s",
			dur(d.cfg.LiveWindow), dur(d.cfg.LiveWindow))}
	return f, nil
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func strJoinOr(s []string, empty string) string {
	if len(s) == 0 {
		return empty
	}
	return strings.Join(s, ", ")
}

const skewSQL = `
SELECT id, member_group, hostname, clock_skew_ms, compute_now() - heartbeat_at
  FROM workers WHERE abs(clock_skew_ms) > $1 ORDER BY abs(clock_skew_ms) DESC, id`

func checkClockSkew(ctx context.Context, d *Doctor) (Finding, error) {
	type row struct {
		id, group, host string
		skew            int64
		age             time.Duration
	}
	var rows []row
	var n int
	err := d.read(ctx, func(tx pgx.Tx) error {
		r, err := tx.Query(ctx, skewSQL, clockSkewThresholdMs)
		if err != nil {
			return err
		}
		if rows, err = pgx.CollectRows(r, func(r pgx.CollectableRow) (row, error) {
			var x row
			return x, r.Scan(&x.id, &x.group, &x.host, &x.skew, &x.age)
		}); err != nil {
			return err
		}
		return tx.QueryRow(ctx, "SELECT count(*) FROM workers").Scan(&n)
	})
	if err != nil {
		return Finding{}, err
	}
	if len(rows) == 0 {
		f := ok(fmt.Sprintf("no process reports clock skew over %dms (%s)", clockSkewThresholdMs, plural(n, "workers row", "workers rows")))
		f.add("threshold_ms", "%d", clockSkewThresholdMs)
		return f, nil
	}
	f := warn(fmt.Sprintf("%s ClockSkew: worst %s at %+dms", plural(len(rows), "process reports", "processes report"), rows[0].id, rows[0].skew),
		"synchronise these hosts' clocks (chrony/NTP): leases use the database clock, but certificates, local timers and logs do not")
	f.add("threshold_ms", "%d", clockSkewThresholdMs)
	capped(&f, "worker", rows, func(x row) string {
		return fmt.Sprintf("%s (%s, %s) skew %+dms, reported %s ago", x.id, orDash(x.host), x.group, x.skew, dur(x.age))
	})
	return f, nil
}

func listOrNone(ids []string) string {
	if len(ids) == 0 {
		return "none"
	}
	return strings.Join(ids, ", ")
}
