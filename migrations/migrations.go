// Package migrations holds leasehold's numbered SQL migrations, embedded in
// every binary, and applies them with goose.
//
// Migrations only move forward in production. A database whose schema is newer
// than the binary (a rollback of the binary after a newer release migrated) is
// refused with ErrDatabaseNewer rather than run against a schema it does not
// know.
package migrations

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"

	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" database/sql driver
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

//go:embed sql/*.sql
var embedded embed.FS

// ErrDatabaseNewer reports a database migrated past the newest migration this
// binary embeds.
var ErrDatabaseNewer = errors.New("database schema is newer than this binary")

// FS returns the embedded migration files (numbered NNNNN_name.sql).
func FS() fs.FS {
	sub, err := fs.Sub(embedded, "sql")
	if err != nil {
		panic(err) // the embedded tree always has sql/
	}
	return sub
}

// Status describes a database against the embedded migrations.
type Status struct {
	// Current is the newest applied version (0 for an empty database).
	Current int64
	// Target is the newest version this binary embeds.
	Target int64
	// Pending counts embedded migrations not yet applied.
	Pending int
}

func newProvider(db *sql.DB, locking bool) (*goose.Provider, error) {
	opts := []goose.ProviderOption{goose.WithDisableGlobalRegistry(true)}
	if locking {
		// A session advisory lock serialises concurrent `--migrate` runs of
		// several processes. It needs a session connection: run migrations
		// with a direct URL, never through PgBouncer transaction mode.
		locker, err := lock.NewPostgresSessionLocker()
		if err != nil {
			return nil, fmt.Errorf("migration lock: %w", err)
		}
		opts = append(opts, goose.WithSessionLocker(locker))
	}
	p, err := goose.NewProvider(goose.DialectPostgres, db, FS(), opts...)
	if err != nil {
		return nil, fmt.Errorf("load migrations: %w", err)
	}
	return p, nil
}

// Open opens a database/sql handle on url with the pgx driver.
func Open(url string) (*sql.DB, error) {
	db, err := sql.Open("pgx", url)
	if err != nil {
		return nil, fmt.Errorf("open database: %w", err)
	}
	return db, nil
}

// Check returns the database's status against the embedded migrations and
// ErrDatabaseNewer (wrapped, with both versions) when the database is ahead.
func Check(ctx context.Context, db *sql.DB) (Status, error) {
	p, err := newProvider(db, false)
	if err != nil {
		return Status{}, err
	}
	return status(ctx, p)
}

func status(ctx context.Context, p *goose.Provider) (Status, error) {
	current, err := p.GetDBVersion(ctx)
	if err != nil {
		return Status{}, fmt.Errorf("read schema version: %w", err)
	}
	st := Status{Current: current}
	for _, s := range p.ListSources() {
		if s.Version > st.Target {
			st.Target = s.Version
		}
		if s.Version > current {
			st.Pending++
		}
	}
	if current > st.Target {
		return st, fmt.Errorf("%w: database is at version %d, this binary knows up to %d; upgrade the binary or restore the schema",
			ErrDatabaseNewer, current, st.Target)
	}
	return st, nil
}

// Up applies every pending migration and returns the resulting status. It
// refuses (ErrDatabaseNewer) a database newer than the binary before applying
// anything.
func Up(ctx context.Context, db *sql.DB, logger *slog.Logger) (Status, error) {
	return apply(ctx, db, logger, "apply migrations", func(ctx context.Context, p *goose.Provider) ([]*goose.MigrationResult, error) {
		return p.Up(ctx)
	})
}

// UpTo applies the pending migrations up to and including version and
// returns the resulting status: a staged upgrade, and the tests that show
// a release working against the schema of the next one. It refuses a
// database newer than the binary, as Up does.
func UpTo(ctx context.Context, db *sql.DB, version int64, logger *slog.Logger) (Status, error) {
	return apply(ctx, db, logger, fmt.Sprintf("apply migrations up to %d", version),
		func(ctx context.Context, p *goose.Provider) ([]*goose.MigrationResult, error) {
			return p.UpTo(ctx, version)
		})
}

// apply runs up on a locking provider once the database is known not to be
// newer than the binary, logs each migration applied and returns the
// resulting status; what names the step in errors.
func apply(ctx context.Context, db *sql.DB, logger *slog.Logger, what string,
	up func(context.Context, *goose.Provider) ([]*goose.MigrationResult, error)) (Status, error) {
	p, err := newProvider(db, true)
	if err != nil {
		return Status{}, err
	}
	if _, err := status(ctx, p); err != nil {
		return Status{}, err
	}
	results, err := up(ctx, p)
	if err != nil {
		return Status{}, fmt.Errorf("%s: %w", what, err)
	}
	for _, r := range results {
		if logger != nil {
			logger.Info("migration applied", "version", r.Source.Version, "path", r.Source.Path, "duration", r.Duration)
		}
	}
	return status(ctx, p)
}

// UpURL is Up on a fresh connection to url, closed on return.
func UpURL(ctx context.Context, url string, logger *slog.Logger) (Status, error) {
	db, err := Open(url)
	if err != nil {
		return Status{}, err
	}
	defer db.Close()
	return Up(ctx, db, logger)
}
