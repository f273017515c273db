package doctor

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// CodeDBRestored reports a database that went back in time: a process found
// it behind what it had seen (pkg/coord, restore.go), which is what
// restoring an earlier backup under running processes does.
const CodeDBRestored = "db.restored"

// restoredAnchor is the operator's procedure.
const restoredAnchor = "docs/database-failover.md#a-database-restored-from-an-earlier-backup"

const instanceSQL = `SELECT id::text, generation, generation_at FROM leasehold_instance`

// openRegressionsSQL lists the detections no operator has acknowledged,
// newest first.
const openRegressionsSQL = `
SELECT detected_by, coalesce(lease_name, ''), coalesce(seen_epoch, 0), coalesce(found_epoch, 0),
       seen_floor, found_floor, seen_grants, found_grants, coalesce(raised_generation, 0),
       compute_now() - detected_at
  FROM epoch_regressions
 WHERE acknowledged_at IS NULL
 ORDER BY detected_at DESC, id DESC`

const acknowledgedSQL = `SELECT count(*) FROM epoch_regressions WHERE acknowledged_at IS NOT NULL`

type regression struct {
	by, lease               string
	seenEpoch, foundEpoch   int64
	seenFloor, foundFloor   int64
	seenGrants, foundGrants int64
	raised                  int64
	age                     time.Duration
}

func (r regression) String() string {
	s := fmt.Sprintf("%s ago by %s: ", dur(r.age), r.by)
	if r.lease != "" {
		s += fmt.Sprintf("%s held at epoch %d, the database had epoch %d", r.lease, r.seenEpoch, r.foundEpoch)
	} else {
		s += fmt.Sprintf("%d grants seen (epoch floor %d), the database had %d (floor %d)", r.seenGrants, r.seenFloor, r.foundGrants, r.foundFloor)
	}
	if r.raised > 0 {
		s += fmt.Sprintf("; raised the generation to %d", r.raised)
	}
	return s
}

func checkRestored(ctx context.Context, d *Doctor) (Finding, error) {
	var (
		id           string
		generation   int64
		generationAt *time.Time
		open         []regression
		acknowledged int
	)
	err := d.read(ctx, func(tx pgx.Tx) error {
		err := tx.QueryRow(ctx, instanceSQL).Scan(&id, &generation, &generationAt)
		if errors.Is(err, pgx.ErrNoRows) {
			id = ""
		} else if err != nil {
			return err
		}
		rows, err := tx.Query(ctx, openRegressionsSQL)
		if err != nil {
			return err
		}
		if open, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (regression, error) {
			var g regression
			return g, r.Scan(&g.by, &g.lease, &g.seenEpoch, &g.foundEpoch, &g.seenFloor, &g.foundFloor,
				&g.seenGrants, &g.foundGrants, &g.raised, &g.age)
		}); err != nil {
			return err
		}
		return tx.QueryRow(ctx, acknowledgedSQL).Scan(&acknowledged)
	})
	if err != nil {
		return Finding{}, err
	}
	if id == "" {
		f := critical("the leasehold_instance row is missing: the restore generation reads as 0",
			"something deleted it, or a restore left it out: restore it from the backup's schema (migration 00030) and follow "+restoredAnchor)
		return f, nil
	}
	if len(open) == 0 {
		f := ok(fmt.Sprintf("no process found the database behind what it had seen (generation %d)", generation))
		f.add("instance", "%s", id)
		f.add("generation", "%d", generation)
		f.add("acknowledged", "%d", acknowledged)
		return f, nil
	}
	worst := open[0]
	for _, r := range open {
		if r.lease != "" && (worst.lease == "" || r.seenEpoch-r.foundEpoch > worst.seenEpoch-worst.foundEpoch) {
			worst = r
		}
	}
	var what string
	if worst.lease != "" {
		what = fmt.Sprintf("%s held %s at epoch %d but the database had it at epoch %d", worst.by, worst.lease, worst.seenEpoch, worst.foundEpoch)
	} else {
		what = fmt.Sprintf("%s had seen %d grants of leases but the database had %d", worst.by, worst.seenGrants, worst.foundGrants)
	}
	f := critical(fmt.Sprintf("the database went back in time: %s (%s, last %s ago); follow %s",
		what, plural(len(open), "detection", "detections"), dur(open[0].age), restoredAnchor),
		fmt.Sprintf("a backup older than what running processes had seen was restored under them (or the database was replaced): "+
			"no epoch is handed out twice (new holdings start at generation %d), but whatever was written after the backup is gone. "+
			"Follow %s, then acknowledge with UPDATE epoch_regressions SET acknowledged_at = now() WHERE acknowledged_at IS NULL",
			generation, restoredAnchor))
	f.add("instance", "%s", id)
	f.add("generation", "%d", generation)
	if generationAt != nil {
		f.add("generation_at", "%s", generationAt.UTC().Format(time.RFC3339))
	}
	capped(&f, "regression", open, regression.String)
	return f, nil
}
