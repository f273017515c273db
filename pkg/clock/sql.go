package clock

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"
)

// Execer runs a statement: *pgxpool.Pool, *pgx.Conn and pgx.Tx all are.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// InstallSQL makes compute_now() in the database behind db follow s, so
// leases compared in SQL and timers in processes running New(s) agree on
// simulated time. It stores (epoch, rate) in the one-row table
// leasehold_sim_clock and replaces compute_now() with a function reading
// it. For benches and simulators only: run it on a database of their own,
// after migrations and before any service starts; UninstallSQL undoes it.
func InstallSQL(ctx context.Context, db Execer, s Scale) error {
	if err := s.Validate(); err != nil {
		return err
	}
	for _, stmt := range []struct {
		sql  string
		args []any
	}{
		{`CREATE TABLE IF NOT EXISTS leasehold_sim_clock (
			only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
			epoch timestamptz NOT NULL,
			rate double precision NOT NULL CHECK (rate >= 1))`, nil},
		{`INSERT INTO leasehold_sim_clock (epoch, rate) VALUES ($1, $2)
			ON CONFLICT (only_row) DO UPDATE SET epoch = excluded.epoch, rate = excluded.rate`, []any{s.Epoch, s.Rate}},
		{`CREATE OR REPLACE FUNCTION compute_now() RETURNS timestamptz
			LANGUAGE sql VOLATILE PARALLEL SAFE
			AS $$ SELECT c.epoch + (clock_timestamp() - c.epoch) * c.rate FROM leasehold_sim_clock c $$`, nil},
	} {
		if _, err := db.Exec(ctx, stmt.sql, stmt.args...); err != nil {
			return fmt.Errorf("install scaled compute_now(): %w", err)
		}
	}
	return nil
}

// UninstallSQL restores the production compute_now() (the server's clock)
// and drops leasehold_sim_clock.
func UninstallSQL(ctx context.Context, db Execer) error {
	for _, sql := range []string{
		`CREATE OR REPLACE FUNCTION compute_now() RETURNS timestamptz
			LANGUAGE sql VOLATILE PARALLEL SAFE
			AS $$ SELECT clock_timestamp() $$`,
		`DROP TABLE IF EXISTS leasehold_sim_clock`,
	} {
		if _, err := db.Exec(ctx, sql); err != nil {
			return fmt.Errorf("restore compute_now(): %w", err)
		}
	}
	return nil
}
