// Package pgdb opens leasehold's pgx pools and runs transactions on them.
//
// Every pool is safe behind PgBouncer in transaction mode: it keeps no session
// state (no prepared statements across transactions, no advisory locks, no
// session settings). LISTEN needs a session connection and is opened apart,
// on a direct URL (see Listener).
package pgdb

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Config describes a pool.
type Config struct {
	// URL is a libpq-style connection URL or DSN.
	URL string
	// AppName is reported as application_name (visible in pg_stat_activity).
	AppName string
	// MaxConns caps the pool (0: pgx's default of max(4, GOMAXPROCS)).
	MaxConns int32
	// ConnectTimeout bounds each dial (0: 5 s).
	ConnectTimeout time.Duration
	// Pooler true marks a URL that goes through a transaction-mode pooler:
	// statements use the simple protocol's exec mode without a statement
	// cache so nothing outlives a transaction.
	Pooler bool
	// Setting names where URL came from in errors ("--database-url");
	// empty: "database url".
	Setting string
	// ReadOnly marks a pool that never writes (doctor): it may reach a
	// standby and list several hosts without target_session_attrs. Any
	// other pool refuses both (a *URLError naming Setting).
	ReadOnly bool
	// Tracer, when set, traces the pool's queries (tracing.PgxTracer).
	Tracer pgx.QueryTracer
	// GenericPlans plans each cached statement once per connection
	// (plan_cache_mode = force_generic_plan) instead of for every call.
	// PostgreSQL otherwise keeps re-planning a statement whose custom plans
	// look cheaper than the generic one, which for the gateway's array-
	// parameter statements costs more than running them (1.2-1.7 ms of
	// planning per group commit; docs/decisions.md "Throughput"). Only for
	// pools whose statements write every value that could pick an index as
	// a literal, not a parameter. Ignored with Pooler: a transaction-mode
	// pooler refuses unknown startup parameters and a SET would leak to
	// other clients.
	GenericPlans bool
}

func (c Config) setting() string {
	if c.Setting == "" {
		return "database url"
	}
	return c.Setting
}

// Connect opens a pool and pings it. A down database is an error here; a
// database that goes away later is redialled on the next checkout, so a
// restarted or promoted server needs no process restart. Unless
// cfg.ReadOnly, a server in recovery (a standby) is refused with a
// *URLError wrapping ErrStandby: leasehold's writes would all fail there.
func Connect(ctx context.Context, cfg Config) (*pgxpool.Pool, error) {
	pcfg, err := PoolConfig(cfg)
	if err != nil {
		return nil, err
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("open pool: %w", err)
	}
	pingCtx, cancel := context.WithTimeout(ctx, pcfg.ConnConfig.ConnectTimeout+time.Second)
	defer cancel()
	if err := pool.Ping(pingCtx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("ping database: %w", err)
	}
	if !cfg.ReadOnly {
		if err := checkPrimary(pingCtx, pool, &pcfg.ConnConfig.Config, cfg.setting()); err != nil {
			pool.Close()
			return nil, err
		}
	}
	return pool, nil
}

// PoolConfig builds the pgxpool configuration for cfg without dialling.
// Unless cfg.ReadOnly, a URL listing several hosts without
// target_session_attrs=read-write (or primary) is refused with a *URLError
// wrapping ErrMultiHostAnyServer.
func PoolConfig(cfg Config) (*pgxpool.Config, error) {
	if cfg.URL == "" {
		return nil, fmt.Errorf("%s is empty", cfg.setting())
	}
	pcfg, err := pgxpool.ParseConfig(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("parse %s: %w", cfg.setting(), err)
	}
	if !cfg.ReadOnly {
		if err := checkConfig(&pcfg.ConnConfig.Config, cfg.setting()); err != nil {
			return nil, err
		}
	}
	if cfg.MaxConns > 0 {
		pcfg.MaxConns = cfg.MaxConns
	}
	pcfg.ConnConfig.ConnectTimeout = cfg.ConnectTimeout
	if pcfg.ConnConfig.ConnectTimeout == 0 {
		pcfg.ConnConfig.ConnectTimeout = 5 * time.Second
	}
	if cfg.AppName != "" {
		pcfg.ConnConfig.RuntimeParams["application_name"] = cfg.AppName
	}
	if cfg.Pooler {
		pcfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
		pcfg.ConnConfig.StatementCacheCapacity = 0
		pcfg.ConnConfig.DescriptionCacheCapacity = 0
	}
	if cfg.Tracer != nil {
		pcfg.ConnConfig.Tracer = cfg.Tracer
	}
	if cfg.GenericPlans && !cfg.Pooler {
		pcfg.ConnConfig.RuntimeParams["plan_cache_mode"] = "force_generic_plan"
	}
	pcfg.HealthCheckPeriod = 5 * time.Second
	pcfg.MaxConnIdleTime = time.Minute
	return pcfg, nil
}

// Beginner starts transactions: a *pgxpool.Pool, a *pgx.Conn, or a pgx.Tx
// (whose Begin opens a savepoint).
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// InTx runs fn in a transaction begun on db and commits it when fn returns
// nil; otherwise it rolls back and returns fn's error. When db is a pgx.Tx
// the transaction is a savepoint of it, so helpers nest.
func InTx(ctx context.Context, db Beginner, fn func(pgx.Tx) error) (err error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	if err := fn(tx); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

// Now reads compute_now(), the one clock of every lease comparison.
func Now(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (time.Time, error) {
	var t time.Time
	if err := q.QueryRow(ctx, "SELECT compute_now()").Scan(&t); err != nil {
		return time.Time{}, fmt.Errorf("read compute_now(): %w", err)
	}
	return t, nil
}

// IsConnectionError reports whether err is a lost or refused connection
// rather than a statement's own failure: the caller retries on its next pass.
func IsConnectionError(err error) bool {
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		// Class 08: connection exception; 57P01-57P03: admin shutdown, crash, cannot connect now.
		return pgErr.Code[:2] == "08" || pgErr.Code == "57P01" || pgErr.Code == "57P02" || pgErr.Code == "57P03"
	}
	return pgconn.SafeToRetry(err) || errors.Is(err, context.DeadlineExceeded) || isNetErr(err)
}

// Querier runs statements: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}
