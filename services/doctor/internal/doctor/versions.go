package doctor

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"golang.org/x/mod/semver"

	"github.com/leasehold/leasehold/pkg/buildinfo"
)

// CodeNodesVersions is the daemon version histogram of the fleet.
const CodeNodesVersions = "nodes.versions"

// daemonVersionsSQL counts the daemon versions of the nodes that have said
// Hello (registered-only nodes report none yet) and are not revoked.
const daemonVersionsSQL = `
SELECT daemon_version, count(*), min(id)
  FROM nodes WHERE state NOT IN ('registered', 'revoked')
 GROUP BY daemon_version
 ORDER BY count(*) DESC, daemon_version`

type versionRow struct {
	version, example string
	count            int
}

func versionLabel(v string) string {
	if v == "" {
		return "(none)"
	}
	return v
}

// checkNodesVersions lists the daemon versions of the fleet, most common
// first; with --min-daemon-version it warns about nodes below it, which
// their gateway will refuse on their next Hello.
func checkNodesVersions(ctx context.Context, d *Doctor) (Finding, error) {
	var rows []versionRow
	err := d.read(ctx, func(tx pgx.Tx) error {
		r, err := tx.Query(ctx, daemonVersionsSQL)
		if err != nil {
			return err
		}
		rows, err = pgx.CollectRows(r, func(r pgx.CollectableRow) (versionRow, error) {
			var v versionRow
			return v, r.Scan(&v.version, &v.count, &v.example)
		})
		return err
	})
	if err != nil {
		return Finding{}, err
	}
	total := 0
	var below []versionRow
	belowNodes := 0
	minimum := buildinfo.Release(d.cfg.MinDaemonVersion)
	for _, v := range rows {
		total += v.count
		if minimum != "" {
			if r := buildinfo.Release(v.version); r == "" || semver.Compare(r, minimum) < 0 {
				below = append(below, v)
				belowNodes += v.count
			}
		}
	}
	var f Finding
	switch {
	case total == 0:
		f = ok("no node has reported a daemon version yet")
	case belowNodes > 0:
		f = warn(fmt.Sprintf("%d of %d nodes run a daemon older than %s (%s)", belowNodes, total, minimum,
			plural(len(below), "version", "versions")),
			"gateways with --gateway.min-daemon-version refuse these daemons on their next Hello (FAILED_PRECONDITION, retry after 5-10 min); "+
				"upgrade them, or lower the minimum until they are")
	default:
		f = ok(fmt.Sprintf("%s across %s", plural(len(rows), "daemon version", "daemon versions"), plural(total, "node", "nodes")))
	}
	if minimum != "" {
		f.add("minimum", "%s", minimum)
	}
	capped(&f, "version", rows, func(v versionRow) string {
		return fmt.Sprintf("%s: %s (e.g. %s)", versionLabel(v.version), plural(v.count, "node", "nodes"), v.example)
	})
	capped(&f, "below_minimum", below, func(v versionRow) string {
		return fmt.Sprintf("%s: %s", versionLabel(v.version), plural(v.count, "node", "nodes"))
	})
	return f, nil
}
