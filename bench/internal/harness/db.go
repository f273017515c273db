package harness

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leasehold/leasehold/migrations"
	"github.com/leasehold/leasehold/pkg/fleettest"
	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/pglocal"
)

// Server is a PostgreSQL server the bench may create databases on: a
// throwaway pglocal cluster, or the one named by LEASEHOLD_DATABASE_URL.
type Server struct {
	// AdminURL reaches a database to run CREATE DATABASE from.
	AdminURL string
	// Desc says what the server is, for the report.
	Desc    string
	cluster *pglocal.Cluster
}

// StartServer starts a local cluster (durable: fsync and synchronous commit
// on) unless LEASEHOLD_DATABASE_URL is set.
func StartServer(ctx context.Context, durable bool) (*Server, error) {
	return StartServerOn(ctx, durable, nil, nil)
}

// StartServerOn is StartServer with a local cluster that also listens on
// listen (addresses that exist now) and lets clients from hostAuth (CIDRs)
// log in with a password: for members run in a network namespace.
func StartServerOn(ctx context.Context, durable bool, listen, hostAuth []string) (*Server, error) {
	if u := os.Getenv("LEASEHOLD_DATABASE_URL"); u != "" {
		return &Server{AdminURL: u, Desc: "LEASEHOLD_DATABASE_URL"}, nil
	}
	dir, err := os.MkdirTemp("", "leasehold-bench-pg-")
	if err != nil {
		return nil, err
	}
	c, err := pglocal.New(ctx, pglocal.Options{Dir: dir, Durable: durable, Listen: listen, HostAuth: hostAuth, Settings: map[string]string{
		"max_connections": "1000", "pg_stat_statements.max": "10000"}})
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if err := c.Start(ctx); err != nil {
		_ = c.Remove(context.Background())
		return nil, err
	}
	var version string
	if conn, err := pgx.Connect(ctx, c.URL("postgres")); err == nil {
		_ = conn.QueryRow(ctx, "SHOW server_version").Scan(&version)
		conn.Close(ctx)
	}
	desc := fmt.Sprintf("local PostgreSQL %s (pglocal, durable=%v)", version, durable)
	return &Server{AdminURL: c.URL("postgres"), Desc: desc, cluster: c}, nil
}

// Stop removes a local cluster; a server from the environment is left alone.
func (s *Server) Stop() {
	if s.cluster != nil {
		_ = s.cluster.Remove(context.Background())
	}
}

// Database is a fresh, migrated database.
type Database struct {
	Name string
	URL  string
	Pool *pgxpool.Pool
	srv  *Server
}

// CreateDatabase creates and migrates a fresh database with
// pg_stat_statements installed.
func (s *Server) CreateDatabase(ctx context.Context, prefix string) (*Database, error) {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	name := prefix + "_" + hex.EncodeToString(b)
	admin, err := pgx.Connect(ctx, s.AdminURL)
	if err != nil {
		return nil, fmt.Errorf("connect admin: %w", err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return nil, fmt.Errorf("create database: %w", err)
	}
	u, err := url.Parse(s.AdminURL)
	if err != nil {
		return nil, err
	}
	u.Path = "/" + name
	d := &Database{Name: name, URL: u.String(), srv: s}
	if _, err := migrations.UpURL(ctx, d.URL, slog.New(slog.DiscardHandler)); err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	cfg, err := pgxpool.ParseConfig(d.URL)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = 16
	if d.Pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		return nil, err
	}
	if _, err := d.Pool.Exec(ctx, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"); err != nil {
		fmt.Fprintf(os.Stderr, "note: pg_stat_statements unavailable: %v\n", err)
	}
	return d, nil
}

// Drop closes the pool and drops the database.
func (d *Database) Drop() {
	d.Pool.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if admin, err := pgx.Connect(ctx, d.srv.AdminURL); err == nil {
		_, _ = admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{d.Name}.Sanitize()+" WITH (FORCE)")
		admin.Close(ctx)
	}
}

// Xacts returns xact_commit + xact_rollback of the database.
func (d *Database) Xacts(ctx context.Context) (int64, error) {
	var n int64
	err := d.Pool.QueryRow(ctx, `SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()`).Scan(&n)
	return n, err
}

// RowWrites returns the rows inserted, updated and deleted in the database
// (pg_stat_database; backends report them at most about once a second).
func (d *Database) RowWrites(ctx context.Context) (int64, error) {
	var n int64
	err := d.Pool.QueryRow(ctx, `SELECT tup_inserted + tup_updated + tup_deleted FROM pg_stat_database WHERE datname = current_database()`).Scan(&n)
	return n, err
}

// TableWrites are the database's row writes summed over its tables
// (pg_stat_user_tables; reported by backends like RowWrites).
type TableWrites struct {
	// Inserts and Updates are rows inserted and updated; HOTUpdates are the
	// updates that wrote no index entry (heap-only tuples).
	Inserts, Updates, HOTUpdates int64
}

// Writes returns the database's TableWrites.
func (d *Database) Writes(ctx context.Context) (TableWrites, error) {
	var w TableWrites
	err := d.Pool.QueryRow(ctx, `
SELECT coalesce(sum(n_tup_ins), 0)::bigint, coalesce(sum(n_tup_upd), 0)::bigint, coalesce(sum(n_tup_hot_upd), 0)::bigint
  FROM pg_stat_user_tables`).Scan(&w.Inserts, &w.Updates, &w.HOTUpdates)
	return w, err
}

// WALBytes returns the WAL the server has written since its statistics
// were reset (pg_stat_wal: the whole server, not one database).
func (d *Database) WALBytes(ctx context.Context) (int64, error) {
	var n int64
	err := d.Pool.QueryRow(ctx, `SELECT wal_bytes::bigint FROM pg_stat_wal`).Scan(&n)
	return n, err
}

// ResetStatements resets pg_stat_statements.
func (d *Database) ResetStatements(ctx context.Context) error {
	_, err := d.Pool.Exec(ctx, "SELECT pg_stat_statements_reset()")
	return err
}

// ownStatements is pg_stat_statements of this database, the bench's own
// monitoring queries (marked /*bench*/ or reading pg_stat_*) left out.
const ownStatements = `FROM pg_stat_statements s JOIN pg_database db ON db.oid = s.dbid
 WHERE db.datname = current_database() AND s.query NOT LIKE '%pg_stat_%' AND s.query NOT LIKE '%/*bench*/%'`

// Statements returns the calls pg_stat_statements counted in this database
// since the last reset, leaving out the bench's own monitoring queries.
func (d *Database) Statements(ctx context.Context) (int64, error) {
	var n int64
	err := d.Pool.QueryRow(ctx, `SELECT coalesce(sum(calls), 0)::bigint `+ownStatements).Scan(&n)
	return n, err
}

// StatementCalls is one normalised statement and how often it ran.
type StatementCalls struct {
	Query string `json:"query"`
	Calls int64  `json:"calls"`
}

// TopStatements returns the n statements pg_stat_statements counted most
// often in this database since the last reset (the bench's own left out),
// each query cut to 120 characters.
func (d *Database) TopStatements(ctx context.Context, n int) ([]StatementCalls, error) {
	rows, err := d.Pool.Query(ctx, `SELECT left(regexp_replace(s.query, '\s+', ' ', 'g'), 120), s.calls `+ownStatements+` ORDER BY s.calls DESC LIMIT $1`, n)
	if err != nil {
		return nil, fmt.Errorf("read pg_stat_statements: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[StatementCalls])
}

// RegisterNodes inserts n nodes named prefix-<i> with fresh credentials.
func RegisterNodes(ctx context.Context, db *pgxpool.Pool, prefix string, n int) (ids, creds []string, err error) {
	hashes := make([][]byte, n)
	for i := range n {
		c, err := nodeauth.NewCredential()
		if err != nil {
			return nil, nil, err
		}
		ids = append(ids, fmt.Sprintf("%s-%d", prefix, i))
		creds = append(creds, c)
		hashes[i] = nodeauth.Hash(c)
	}
	if _, err := db.Exec(ctx, `INSERT INTO nodes (id) SELECT unnest($1::text[])`, ids); err != nil {
		return nil, nil, fmt.Errorf("register nodes: %w", err)
	}
	if _, err := db.Exec(ctx, `INSERT INTO node_credentials (node_id, credential_hash) SELECT * FROM unnest($1::text[], $2::bytea[])`, ids, hashes); err != nil {
		return nil, nil, fmt.Errorf("register credentials: %w", err)
	}
	return ids, creds, nil
}

// FreeAddr returns a free loopback address.
func FreeAddr() string {
	// fleettest's handout: outside the kernel's ephemeral range (which the
	// members' own outgoing connections draw from) and never twice.
	port, err := fleettest.FreePort()
	if err != nil {
		panic(err)
	}
	return fmt.Sprintf("127.0.0.1:%d", port)
}

// Host returns a short description of the machine.
func Host() string {
	cpus := "?"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		cpus = fmt.Sprint(strings.Count(string(b), "processor\t:"))
	}
	mem := "?"
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		var kb int64
		if _, err := fmt.Sscanf(strings.SplitN(string(b), "\n", 2)[0], "MemTotal: %d kB", &kb); err == nil {
			mem = fmt.Sprintf("%.0f GiB", float64(kb)/(1<<20))
		}
	}
	load := ""
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		load = strings.Join(strings.Fields(string(b))[:3], " ")
	}
	return fmt.Sprintf("%s cores, %s, load %s", cpus, mem, load)
}

// CPU returns the CPU seconds (user + system) the local cluster's processes
// have used so far: the postmaster, its live children and the children it
// has reaped. ok is false for a server from the environment.
func (s *Server) CPU() (secs float64, ok bool) {
	if s.cluster == nil {
		return 0, false
	}
	b, err := os.ReadFile(filepath.Join(s.cluster.DataDir(), "postmaster.pid"))
	if err != nil {
		return 0, false
	}
	pid := strings.TrimSpace(strings.SplitN(string(b), "\n", 2)[0])
	total, _, _ := procStat(pid, true)
	procs, _ := os.ReadDir("/proc")
	for _, e := range procs {
		if e.Name()[0] < '0' || e.Name()[0] > '9' {
			continue
		}
		if n, ppid, ok := procStat(e.Name(), false); ok && ppid == pid {
			total += n
		}
	}
	return float64(total) / userHZ, true
}

// StatementCost is one normalised statement, how often it ran and the
// server time it took in all (pg_stat_statements' total_exec_time).
type StatementCost struct {
	Query  string  `json:"query"`
	Calls  int64   `json:"calls"`
	ExecMs float64 `json:"exec_ms"`
}

// CostliestStatements returns the n statements that took the most server
// time in this database since the last reset (the bench's own left out),
// each query cut to 160 characters.
func (d *Database) CostliestStatements(ctx context.Context, n int) ([]StatementCost, error) {
	rows, err := d.Pool.Query(ctx, `SELECT left(regexp_replace(s.query, '\s+', ' ', 'g'), 160), s.calls, s.total_exec_time `+ownStatements+` ORDER BY s.total_exec_time DESC LIMIT $1`, n)
	if err != nil {
		return nil, fmt.Errorf("read pg_stat_statements: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[StatementCost])
}
