package doctor

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/pkg/pgdb"
)

// checkURL judges doctor's own --database-url the way services judge
// theirs at start (pkg/pgdb): several hosts without
// target_session_attrs=read-write, or a server in recovery, would be refused
// by a service given the same URL. Doctor only reads, so it still runs and
// says so.
func checkURL(ctx context.Context, d *Doctor) (Finding, error) {
	cc := &d.db.Config().ConnConfig.Config
	hosts := pgdb.Hosts(cc)
	attrs := pgdb.TargetSessionAttrs(cc)
	var recovery bool
	if err := d.read(ctx, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&recovery)
	}); err != nil {
		return Finding{}, err
	}
	var f Finding
	switch {
	case !pgdb.WritesOnlyToPrimary(cc):
		f = warn(fmt.Sprintf("the database URL lists %d hosts without target_session_attrs=read-write: a connection may land on a standby or a stale old primary", len(hosts)),
			"add target_session_attrs=read-write to the URL (postgres://u:p@h1:5432,h2:5432/db?target_session_attrs=read-write); "+
				"leasehold services refuse this URL at start (--database-url)")
	case recovery:
		f = warn("the database URL reaches a standby (pg_is_in_recovery() is true): a service given this URL is refused at start",
			"give services (--database-url) the primary, a name or pooler that follows the primary, or every server with target_session_attrs=read-write")
	case len(hosts) > 1:
		f = ok(fmt.Sprintf("%d hosts with target_session_attrs=%s: connections follow the primary", len(hosts), attrs))
	default:
		f = ok("one host, the primary")
	}
	f.add("hosts", "%s", strings.Join(hosts, ", "))
	f.add("target_session_attrs", "%s", attrs)
	f.add("in_recovery", "%t", recovery)
	return f, nil
}
