package pgdb

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// A generic plan (Config.GenericPlans) is made once, from the statistics the
// tables have when a connection first runs the statement, and kept until
// those statistics change. A table that has never been analyzed is planned
// as ten pages, whatever it holds: a group commit planned on a fresh
// database then joins its batch to commands by scanning the whole table,
// and keeps doing so while the table grows by thousands of rows a second.
// Autovacuum analyzes it within autovacuum_naptime (a minute by default),
// which under load is long enough for the statement to take seconds and
// the backlog to grow faster than it drains. Measured on the throughput
// bench: 50 completed commands/s instead of 3,000 (docs/decisions.md,
// "Generic plans made on a tiny table").
//
// RefreshPlanStats closes that window: one pass analyzes every table of the
// current schema whose live rows exceed both minRows and growth times what
// the planner last recorded, so the next execution of each cached plan is
// planned again from the table's real size. Autovacuum keeps statistics
// within its own thresholds afterwards; the pass only ever acts when they
// are a factor behind.

// PlanStatsMinRows and PlanStatsGrowth are the defaults of the pass: a table
// is analyzed once it holds at least PlanStatsMinRows live rows and more
// than PlanStatsGrowth times the rows its statistics say.
const (
	PlanStatsMinRows = 1000
	PlanStatsGrowth  = 4
)

// staleStatsSQL lists the tables of the current schema whose live row count
// (the statistics system's running count, kept without ANALYZE) is past both
// bounds, among those the role may analyze (owned by a role it is a member
// of, or any as superuser), so a pass never asks for what it cannot do.
const staleStatsSQL = `
SELECT s.schemaname, s.relname, greatest(c.reltuples, 0)::bigint, s.n_live_tup
  FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
 WHERE s.schemaname = current_schema()
   AND s.n_live_tup >= $1
   AND s.n_live_tup > $2::float8 * greatest(c.reltuples, 0)
   AND pg_has_role(c.relowner, 'USAGE')
 ORDER BY s.relname`

// StaleTable is a table RefreshPlanStats analyzed: its rows as the planner
// knew them before, and as counted when the pass looked.
type StaleTable struct {
	Name        string
	PlannedRows int64
	LiveRows    int64
}

// RefreshPlanStats runs one pass and returns the tables it analyzed. An
// ANALYZE that would wait more than a second for its lock (autovacuum is
// analyzing the same table) is skipped: the table is fresh by then anyway.
func RefreshPlanStats(ctx context.Context, db Beginner, minRows int64, growth float64) ([]StaleTable, error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("plan statistics: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	rows, err := tx.Query(ctx, staleStatsSQL, minRows, growth)
	if err != nil {
		return nil, fmt.Errorf("plan statistics: list tables: %w", err)
	}
	type rel struct {
		schema string
		StaleTable
	}
	stale, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (rel, error) {
		var r rel
		err := row.Scan(&r.schema, &r.Name, &r.PlannedRows, &r.LiveRows)
		return r, err
	})
	if err != nil {
		return nil, fmt.Errorf("plan statistics: list tables: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("plan statistics: %w", err)
	}
	var done []StaleTable
	for _, r := range stale {
		ok, err := analyze(ctx, db, pgx.Identifier{r.schema, r.Name}.Sanitize())
		if err != nil {
			return done, fmt.Errorf("plan statistics: analyze %s: %w", r.Name, err)
		}
		if ok {
			done = append(done, r.StaleTable)
		}
	}
	return done, nil
}

// analyze runs ANALYZE on table in a transaction of its own, with a lock
// timeout; false when the lock was not had in time.
func analyze(ctx context.Context, db Beginner, table string) (bool, error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "SET LOCAL lock_timeout = '1s'"); err != nil {
		return false, err
	}
	if _, err := tx.Exec(ctx, "ANALYZE "+table); err != nil {
		if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
			return false, nil
		}
		return false, err
	}
	return true, tx.Commit(ctx)
}
