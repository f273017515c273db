package doctor

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// CodeNodesClockSkew reports connected nodes whose clock is off the
// database's, as their gateways measured it from the nodes' heartbeats.
const CodeNodesClockSkew = "nodes.clock_skew"

// nodeSkewSQL lists the connected sessions whose measured skew is past the
// threshold, worst first, with how long ago the session was last seen.
const nodeSkewSQL = `
SELECT node_id, gateway_id, clock_skew_ms, compute_now() - last_seen_at
  FROM node_sessions
 WHERE state = 'connected' AND abs(clock_skew_ms) > $1
 ORDER BY abs(clock_skew_ms) DESC, node_id`

func checkNodesClockSkew(ctx context.Context, d *Doctor) (Finding, error) {
	type row struct {
		id, gateway string
		skew        int64
		age         time.Duration
	}
	var (
		rows             []row
		connected, known int
	)
	err := d.read(ctx, func(tx pgx.Tx) error {
		r, err := tx.Query(ctx, nodeSkewSQL, clockSkewThresholdMs)
		if err != nil {
			return err
		}
		if rows, err = pgx.CollectRows(r, func(r pgx.CollectableRow) (row, error) {
			var x row
			return x, r.Scan(&x.id, &x.gateway, &x.skew, &x.age)
		}); err != nil {
			return err
		}
		return tx.QueryRow(ctx, `SELECT count(*), count(clock_skew_ms) FROM node_sessions WHERE state = 'connected'`).Scan(&connected, &known)
	})
	if err != nil {
		return Finding{}, err
	}
	if len(rows) == 0 {
		f := ok(fmt.Sprintf("no connected node's clock is off by more than %dms (%d of %s measured)", clockSkewThresholdMs, known,
			plural(connected, "connected node", "connected nodes")))
		f.add("threshold_ms", "%d", clockSkewThresholdMs)
		return f, nil
	}
	f := warn(fmt.Sprintf("%d of %d connected nodes have a clock off the database's by more than %dms: worst %s at %+dms",
		len(rows), connected, clockSkewThresholdMs, rows[0].id, rows[0].skew),
		"synchronise these nodes' clocks (chrony/NTP): commands, leases and deadlines use the database clock, but the nodes' certificates, "+
			"logs and anything their commands time locally do not")
	f.add("threshold_ms", "%d", clockSkewThresholdMs)
	capped(&f, "node", rows, func(x row) string {
		return fmt.Sprintf("%s (gateway %s) skew %+dms, seen %s ago", x.id, x.gateway, x.skew, dur(x.age))
	})
	return f, nil
}
