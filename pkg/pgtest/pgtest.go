// Package pgtest gives tests a real PostgreSQL: one server per test binary and
// one fresh database per test, cloned from a migrated template.
//
// The server comes from, in order:
//  1. LEASEHOLD_TEST_DATABASE_URL (a superuser URL; databases are created in it),
//  2. a throwaway cluster from the local initdb/pg_ctl on a free loopback port.
//
// A PostgreSQL in a Docker container is source 1: tools/pgcontainer (a module
// of its own, so dockertest is required by no module a service builds from)
// starts one through ory/dockertest, runs a command with the URL set and
// removes the container afterwards:
//
//	GOWORK=off go -C tools/pgcontainer run . -- make -C ../.. test
//
// `make test-docker` runs that. CI has no Docker engine, so no CI run
// exercises it. On an external server, the tests of database faults skip
// (Server(t).Restart and Stop: only a cluster this binary started can be
// restarted).
//
// A test package that uses pgtest calls Main from its TestMain so the server
// it started is stopped when the binary exits.
//
// With LEASEHOLD_TEST_PGBOUNCER set, a real PgBouncer in transaction mode
// (pkg/pgbouncer) stands in front of the server and every DB's URL and Pool
// go through it (docs/design.md#tests):
//
//	LEASEHOLD_TEST_PGBOUNCER=1         DB.DirectURL is the direct URL, for LISTEN
//	LEASEHOLD_TEST_PGBOUNCER=nolisten  DB.DirectURL is empty: notifications off, all polls
//
// Databases are still created, and the template migrated, on the direct admin
// URL. Tests that start services pass PoolerFlags(db.URL) (pkg/fleettest does).
package pgtest

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/leasehold/leasehold/migrations"
	"github.com/leasehold/leasehold/pkg/leakcheck"
	"github.com/leasehold/leasehold/pkg/pgbouncer"
	"github.com/leasehold/leasehold/pkg/pgdb"
)

// EnvURL names the environment variable with an external server's URL.
const EnvURL = "LEASEHOLD_TEST_DATABASE_URL"

// EnvPgBouncer names the environment variable selecting the PgBouncer mode:
// unset, "" or "0" off; "1", "true" or "listen" through PgBouncer with a
// direct URL for LISTEN; "nolisten" through PgBouncer without one.
const EnvPgBouncer = "LEASEHOLD_TEST_PGBOUNCER"

// PgBouncer modes, as returned by Mode.
const (
	ModeDirect   = "direct"
	ModeListen   = "pgbouncer"
	ModeNoListen = "pgbouncer-nolisten"
)

// Mode reports how this binary's tests reach PostgreSQL: ModeDirect,
// ModeListen or ModeNoListen, from LEASEHOLD_TEST_PGBOUNCER.
func Mode() string {
	switch strings.ToLower(strings.TrimSpace(os.Getenv(EnvPgBouncer))) {
	case "", "0", "false", "off", "no":
		return ModeDirect
	case "nolisten", "no-listen", "polling":
		return ModeNoListen
	default:
		return ModeListen
	}
}

// Pooled reports whether tests run through PgBouncer (either mode).
func Pooled() bool { return Mode() != ModeDirect }

// NotifyAvailable reports whether tests can LISTEN (false only in the
// nolisten mode), for assertions on a notification mode of "listen".
func NotifyAvailable() bool { return Mode() != ModeNoListen }

const templateDB = "leasehold_template"

var (
	startOnce sync.Once
	srv       *server
	startErr  error
	dbSeq     atomic.Int64
	// inMain is set by Main: without it nothing stops the server this
	// binary starts, so Server refuses to start one.
	inMain atomic.Bool
)

// Main runs the package's tests, stops the server this binary started
// and ends the binary as leakcheck.Exit does: the binaries the tests built
// removed, no goroutine leaked besides LeakOptions. Call it from TestMain.
func Main(m *testing.M) {
	inMain.Store(true)
	code := m.Run()
	if srv != nil {
		srv.stop()
	}
	leakcheck.Exit(code, LeakOptions()...)
}

// LeakOptions are the goroutines goleak ignores in leasehold's tests: the
// long-lived helpers of libraries the tests use, none of them ours.
func LeakOptions() []goleak.Option {
	return []goleak.Option{
		goleak.IgnoreTopFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck"),
		goleak.IgnoreTopFunction("database/sql.(*DB).connectionOpener"),
	}
}

// DB is a fresh database for one test.
type DB struct {
	// Name is the database's name.
	Name string
	// URL connects to it as the superuser; through PgBouncer in a PgBouncer
	// mode (then it carries pgx's exec-mode settings).
	URL string
	// DirectURL connects to it without a pooler: the URL to LISTEN on (and
	// for session state such as advisory locks). It equals URL in the direct
	// mode and is empty in the nolisten mode.
	DirectURL string
	// Pool is an open pool on URL, closed when the test ends.
	Pool *pgxpool.Pool
}

var (
	flagsMu   sync.Mutex
	directFor = map[string]string{} // pooled URL -> DirectURL
)

// PoolerFlags returns the service flags a process started on dbURL (a URL
// from NewDB) needs in the current mode: none in the direct mode, else
// --pooler and, when a direct URL exists, --listen-database-url.
func PoolerFlags(dbURL string) []string {
	if !Pooled() {
		return nil
	}
	flagsMu.Lock()
	direct, ok := directFor[dbURL]
	flagsMu.Unlock()
	if !ok {
		// Not a pooled URL of this binary (e.g. a proxy in front of the
		// direct server): nothing to add.
		return nil
	}
	flags := []string{"--pooler"}
	if direct != "" {
		flags = append(flags, "--listen-database-url", direct)
	}
	return flags
}

// New returns a pool on a fresh, migrated database that lives for the test.
func New(t testing.TB) *pgxpool.Pool {
	t.Helper()
	return NewDB(t).Pool
}

// NewDB creates a fresh, migrated database for the test and returns it.
func NewDB(t testing.TB) *DB {
	t.Helper()
	return newDB(t, templateDB)
}

// NewEmpty creates a fresh database with no migrations applied, for tests
// of the migration path itself.
func NewEmpty(t testing.TB) *DB {
	t.Helper()
	return newDB(t, "template0")
}

func newDB(t testing.TB, template string) *DB {
	t.Helper()
	s := Server(t)
	db, err := createDB(s, template)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, err := pgdb.Connect(ctx, pgdb.Config{URL: db.URL, AppName: "pgtest", MaxConns: 20, Pooler: s.bouncer != nil})
	if err != nil {
		t.Fatalf("pgtest: connect: %v", err)
	}
	t.Cleanup(pool.Close)
	db.Pool = pool
	return db
}

// ExampleURL is NewDB for an Example function, which has no *testing.T:
// the URL of a fresh, migrated database on this test binary's server
// (TestMain must call Main). It panics on failure, which fails the
// example. In a real program the URL comes from configuration.
func ExampleURL() string {
	if !inMain.Load() {
		panic("pgtest: the package's TestMain must call pgtest.Main(m)")
	}
	startOnce.Do(func() {
		srv, startErr = start(context.Background())
	})
	if startErr != nil {
		panic(fmt.Sprintf("pgtest: %v", startErr))
	}
	db, err := createDB(srv, templateDB)
	if err != nil {
		panic(fmt.Sprintf("pgtest: %v", err))
	}
	return db.URL
}

// createDB creates a database from template on s (no pool yet).
func createDB(s *server, template string) (*DB, error) {
	name := fmt.Sprintf("t_%d_%d", os.Getpid(), dbSeq.Add(1))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := s.exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()+" TEMPLATE "+template); err != nil {
		return nil, fmt.Errorf("create database: %w", err)
	}
	db := &DB{Name: name, URL: s.urlFor(name)}
	db.DirectURL = db.URL
	if s.bouncer != nil {
		db.URL = s.bouncer.URL(name)
		if Mode() == ModeNoListen {
			db.DirectURL = ""
		}
		flagsMu.Lock()
		directFor[db.URL] = db.DirectURL
		flagsMu.Unlock()
	}
	return db, nil
}

// Server returns the binary's test server, starting it on first use.
func Server(t testing.TB) *server {
	t.Helper()
	if !inMain.Load() {
		t.Fatalf("pgtest: the package's TestMain must call pgtest.Main(m); without it the PostgreSQL server this binary starts outlives it")
	}
	startOnce.Do(func() {
		srv, startErr = start(context.Background())
	})
	if startErr != nil {
		t.Fatalf("pgtest: %v", startErr)
	}
	return srv
}

type server struct {
	adminURL string
	stop     func()
	bouncer  *pgbouncer.Bouncer
	local    interface {
		Restart(ctx context.Context, immediate bool) error
		Stop(ctx context.Context) error
		Start(ctx context.Context) error
	}
}

// AdminURL is a superuser URL on the server's maintenance database.
func (s *server) AdminURL() string { return s.adminURL }

// Restart restarts the server (fast or immediate shutdown) when this binary
// started it; tests of database faults skip otherwise.
func (s *server) Restart(t testing.TB, immediate bool) {
	t.Helper()
	if s.local == nil {
		t.Skip("pgtest: cannot restart an external server")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := s.local.Restart(ctx, immediate); err != nil {
		t.Fatalf("pgtest: restart: %v", err)
	}
}

// Stop stops the server (fast shutdown) until Start: a database outage for
// every database of this binary. Tests of database faults skip when the
// server is not this binary's own; Start runs at cleanup if the test did not.
func (s *server) Stop(t testing.TB) {
	t.Helper()
	if s.local == nil {
		t.Skip("pgtest: cannot stop an external server")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := s.local.Stop(ctx); err != nil {
		t.Fatalf("pgtest: stop: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		_ = s.local.Start(ctx) // a no-op when already running
	})
}

// Start starts a server stopped by Stop.
func (s *server) Start(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := s.local.Start(ctx); err != nil {
		t.Fatalf("pgtest: start: %v", err)
	}
}

func (s *server) urlFor(db string) string {
	u, err := url.Parse(s.adminURL)
	if err != nil {
		panic(err)
	}
	u.Path = "/" + db
	return u.String()
}

func (s *server) exec(ctx context.Context, sql string) error {
	conn, err := pgx.Connect(ctx, s.adminURL)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, sql)
	return err
}

func start(ctx context.Context) (*server, error) {
	s, err := startServer(ctx)
	if err != nil {
		return nil, err
	}
	if err := s.prepareTemplate(ctx); err != nil {
		s.stop()
		return nil, err
	}
	if Pooled() {
		if err := s.startBouncer(ctx); err != nil {
			s.stop()
			return nil, err
		}
	}
	return s, nil
}

// startBouncer puts a PgBouncer in transaction mode in front of the server.
func (s *server) startBouncer(ctx context.Context) error {
	u, err := url.Parse(s.adminURL)
	if err != nil {
		return fmt.Errorf("parse admin url: %w", err)
	}
	port, err := strconv.Atoi(u.Port())
	if err != nil {
		port = 5432
	}
	pw, _ := u.User.Password()
	host := u.Hostname()
	if host == "localhost" || host == "" {
		host = "127.0.0.1"
	}
	b, err := pgbouncer.Start(ctx, pgbouncer.Options{ServerHost: host, ServerPort: port, User: u.User.Username(), Password: pw})
	if err != nil {
		return fmt.Errorf("%s=%s: %w", EnvPgBouncer, os.Getenv(EnvPgBouncer), err)
	}
	s.bouncer = b
	stopServer := s.stop
	s.stop = func() {
		b.Stop()
		stopServer()
	}
	return nil
}

// PgBouncer is the binary's PgBouncer in a PgBouncer mode, else nil.
func (s *server) PgBouncer() *pgbouncer.Bouncer { return s.bouncer }

func startServer(ctx context.Context) (*server, error) {
	if u := os.Getenv(EnvURL); u != "" {
		return &server{adminURL: u, stop: func() {}}, nil
	}
	return startLocal(ctx)
}

// prepareTemplate creates the migrated template database, or brings an
// existing one (on a shared external server) up to this binary's version.
// An advisory lock serialises test binaries that share one server.
func (s *server) prepareTemplate(ctx context.Context) error {
	conn, err := pgx.Connect(ctx, s.adminURL)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(ctx)
	// Serialise template creation across test binaries sharing one server.
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock(774411)"); err != nil {
		return fmt.Errorf("template lock: %w", err)
	}
	defer func() { _, _ = conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock(774411)") }()
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", templateDB).Scan(&exists); err != nil {
		return fmt.Errorf("look up template: %w", err)
	}
	if !exists {
		if _, err := conn.Exec(ctx, "CREATE DATABASE "+templateDB); err != nil && !strings.Contains(err.Error(), "already exists") {
			return fmt.Errorf("create template: %w", err)
		}
	}
	if _, err := migrations.UpURL(ctx, s.urlFor(templateDB), nil); err != nil {
		return fmt.Errorf("migrate template: %w", err)
	}
	return nil
}
