// Package pgha runs a PostgreSQL primary and a streaming-replication standby
// from the machine's own binaries (initdb, pg_basebackup, pg_ctl, through
// pkg/pglocal), for tests and benches of a database failover: kill or stop
// the primary, promote the standby, and watch leasehold ride through it.
//
// The standby is a pg_basebackup copy of the primary with standby.signal,
// primary_conninfo (application_name "standby") and a physical replication
// slot. With Options.Sync the primary waits for it on every commit
// (synchronous_standby_names = 'standby', synchronous_commit = on): a commit
// that returned is on the standby's disk, so a promotion loses nothing
// acknowledged. Without it replication is asynchronous and a promotion loses
// whatever the standby had not received yet.
//
// The database DBName is created and migrated on the primary before the base
// backup, so both servers hold the schema. Clients that must follow a
// promotion use MultiHostURL (both hosts, target_session_attrs=read-write).
//
// Both servers run as the unprivileged server user when the caller is root
// (see pglocal). Close stops them and deletes their directories; a watchdog
// process does the same if the test binary dies first (a timeout panic skips
// t.Cleanup), so no cluster outlives the binary.
package pgha

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/migrations"
	"github.com/leasehold/leasehold/pkg/pglocal"
)

// DBName is the migrated database both servers hold.
const DBName = "leasehold"

// StandbyName is the standby's application_name and replication slot, the
// name synchronous_standby_names lists in Sync mode.
const StandbyName = "standby"

// Options configures a pair.
type Options struct {
	// Sync makes replication synchronous: every commit on the primary waits
	// until the standby has flushed it.
	Sync bool
	// Settings are extra postgresql.conf lines (name -> quoted value) for
	// both servers, e.g. "max_connections": "1000".
	Settings map[string]string
	// NoMigrate leaves DBName empty (created, not migrated).
	NoMigrate bool
}

// Pair is a running primary and its streaming standby.
type Pair struct {
	opts     Options
	dir      string
	primary  *pglocal.Cluster
	standby  *pglocal.Cluster
	watchIn  io.WriteCloser
	watchCmd *exec.Cmd
	watchErr bytes.Buffer

	mu       sync.Mutex
	promoted bool
	closed   bool
}

// Start starts a pair for the test and stops it at t.Cleanup, even when the
// test fails.
func Start(t testing.TB, opts Options) *Pair {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	p, err := New(ctx, opts)
	if err != nil {
		t.Fatalf("pgha: %v", err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("pgha: close: %v", err)
		}
	})
	return p
}

// New starts a primary, creates and migrates DBName on it, makes the standby
// with pg_basebackup, starts it and waits until it streams (in Sync mode:
// until the primary counts it as its synchronous standby). The caller must
// Close the pair.
func New(ctx context.Context, opts Options) (p *Pair, err error) {
	dir, err := os.MkdirTemp("", "leasehold-pgha-")
	if err != nil {
		return nil, fmt.Errorf("temp dir: %w", err)
	}
	p = &Pair{opts: opts, dir: dir}
	if err := p.startWatchdog(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	defer func() {
		if err != nil {
			_ = p.Close()
		}
	}()
	if p.primary, err = pglocal.New(ctx, pglocal.Options{Dir: filepath.Join(dir, "primary"), Settings: p.settings(nil)}); err != nil {
		return nil, fmt.Errorf("primary: %w", err)
	}
	if err := p.primary.Start(ctx); err != nil {
		return nil, fmt.Errorf("start primary: %w", err)
	}
	if err := p.exec(ctx, p.primary.URL("postgres"), "CREATE DATABASE "+DBName); err != nil {
		return nil, fmt.Errorf("create database: %w", err)
	}
	if !opts.NoMigrate {
		if _, err := migrations.UpURL(ctx, p.primary.URL(DBName), nil); err != nil {
			return nil, fmt.Errorf("migrate primary: %w", err)
		}
	}
	// Commits never wait for a standby on the standby itself, including
	// after its promotion, when it has none.
	if p.standby, err = pglocal.NewStandby(ctx, p.primary, pglocal.Options{Dir: filepath.Join(dir, "standby"),
		Settings: p.settings(map[string]string{"synchronous_standby_names": "''"})}, StandbyName, StandbyName); err != nil {
		return nil, fmt.Errorf("standby: %w", err)
	}
	if err := p.standby.Start(ctx); err != nil {
		return nil, fmt.Errorf("start standby: %w", err)
	}
	if opts.Sync {
		if err := p.exec(ctx, p.primary.URL("postgres"), "ALTER SYSTEM SET synchronous_standby_names = '"+StandbyName+"'"); err != nil {
			return nil, fmt.Errorf("synchronous_standby_names: %w", err)
		}
		if err := p.exec(ctx, p.primary.URL("postgres"), "SELECT pg_reload_conf()"); err != nil {
			return nil, fmt.Errorf("reload primary: %w", err)
		}
	}
	if err := p.waitStreaming(ctx); err != nil {
		return nil, err
	}
	return p, nil
}

// settings are both servers' postgresql.conf lines, then extra, then the
// caller's. fsync stays off (tests kill processes, never the machine, so
// the page cache survives) but commits are synchronous so that "returned"
// means "in the WAL", and full_page_writes is on as base backups need.
func (p *Pair) settings(extra map[string]string) map[string]string {
	s := map[string]string{
		"wal_level":                    "replica",
		"max_wal_senders":              "10",
		"max_replication_slots":        "10",
		"hot_standby":                  "on",
		"full_page_writes":             "on",
		"synchronous_commit":           "on",
		"shared_buffers":               "'64MB'",
		"wal_retrieve_retry_interval":  "'200ms'",
		"wal_receiver_status_interval": "'1s'",
	}
	for k, v := range extra {
		s[k] = v
	}
	for k, v := range p.opts.Settings {
		s[k] = v
	}
	return s
}

// waitStreaming waits until the primary's walsender streams to the standby,
// as its synchronous standby in Sync mode.
func (p *Pair) waitStreaming(ctx context.Context) error {
	want := "async"
	if p.opts.Sync {
		want = "sync"
	}
	return poll(ctx, "standby streaming ("+want+")", func() (bool, error) {
		var n int
		err := p.queryRow(ctx, p.primary.URL("postgres"),
			"SELECT count(*) FROM pg_stat_replication WHERE application_name = $1 AND state = 'streaming' AND sync_state = $2",
			[]any{StandbyName, want}, &n)
		return n == 1, err
	})
}

// Primary is the server started as the primary.
func (p *Pair) Primary() *pglocal.Cluster { return p.primary }

// Standby is the server started as the standby (the primary after Promote).
func (p *Pair) Standby() *pglocal.Cluster { return p.standby }

// PrimaryURL reaches DBName on the server started as the primary.
func (p *Pair) PrimaryURL() string { return p.primary.URL(DBName) }

// StandbyURL reaches DBName on the server started as the standby: read-only
// until Promote, then the writable one.
func (p *Pair) StandbyURL() string { return p.standby.URL(DBName) }

// WriterURL reaches DBName on whichever server currently takes writes.
func (p *Pair) WriterURL() string {
	if p.Promoted() {
		return p.StandbyURL()
	}
	return p.PrimaryURL()
}

// MultiHostURL lists both servers with target_session_attrs=read-write: a
// client connects to the first one that accepts writes, so a pool on it
// follows a promotion with no change of configuration.
func (p *Pair) MultiHostURL() string { return p.MultiHostURLFor(DBName) }

// MultiHostURLFor is MultiHostURL for database db (one created on the
// primary after the start replicates like any other write).
func (p *Pair) MultiHostURLFor(db string) string {
	return fmt.Sprintf("postgres://postgres:postgres@127.0.0.1:%d,127.0.0.1:%d/%s?sslmode=disable&target_session_attrs=read-write",
		p.primary.Port(), p.standby.Port(), db)
}

// Promoted reports whether Promote ran.
func (p *Pair) Promoted() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.promoted
}

// StopPrimary shuts the primary down with pg_ctl stop: fast mode (clients
// cut off, a shutdown checkpoint) or immediate (no checkpoint: crash recovery
// at the next start).
func (p *Pair) StopPrimary(ctx context.Context, immediate bool) error {
	mode := pglocal.StopFast
	if immediate {
		mode = pglocal.StopImmediate
	}
	if err := p.primary.Stop(ctx, mode); err != nil {
		return fmt.Errorf("stop primary: %w", err)
	}
	return nil
}

// StartPrimary starts the stopped or killed primary again and waits until
// the standby streams from it. It refuses after Promote: the old primary
// would be a second writable server with a diverged history.
func (p *Pair) StartPrimary(ctx context.Context) error {
	if p.Promoted() {
		return errors.New("pgha: the standby was promoted; starting the old primary would make two primaries")
	}
	if err := p.primary.Start(ctx); err != nil {
		return fmt.Errorf("start primary: %w", err)
	}
	return p.waitStreaming(ctx)
}

// KillPrimary crashes the primary like a lost host: SIGKILL to the postmaster
// and every server process at once (pglocal.Cluster.Kill).
func (p *Pair) KillPrimary(ctx context.Context) error {
	if err := p.primary.Kill(ctx); err != nil {
		return fmt.Errorf("kill primary: %w", err)
	}
	return nil
}

// Promote promotes the standby (pg_ctl promote) and waits until it runs as a
// primary (pg_is_in_recovery() false). Stop or kill the primary first.
func (p *Pair) Promote(ctx context.Context) error {
	if err := p.standby.Promote(ctx); err != nil {
		return fmt.Errorf("promote standby: %w", err)
	}
	if err := poll(ctx, "standby out of recovery", func() (bool, error) {
		var recovery bool
		err := p.queryRow(ctx, p.standby.URL("postgres"), "SELECT pg_is_in_recovery()", nil, &recovery)
		return err == nil && !recovery, nil
	}); err != nil {
		return err
	}
	p.mu.Lock()
	p.promoted = true
	p.mu.Unlock()
	return nil
}

// WaitReplicated waits until the standby has replayed everything the primary
// had written when it was called (replay LSN >= the primary's current LSN).
func (p *Pair) WaitReplicated(ctx context.Context) error {
	var lsn string
	if err := p.queryRow(ctx, p.primary.URL("postgres"), "SELECT pg_current_wal_lsn()::text", nil, &lsn); err != nil {
		return fmt.Errorf("read primary LSN: %w", err)
	}
	return poll(ctx, "standby replay at "+lsn, func() (bool, error) {
		var ok bool
		err := p.queryRow(ctx, p.standby.URL("postgres"), "SELECT coalesce(pg_last_wal_replay_lsn() >= $1::pg_lsn, false)", []any{lsn}, &ok)
		return ok, err
	})
}

// Timeline is the WAL timeline of the server that takes writes: 1 at start,
// one more on each promotion.
func (p *Pair) Timeline(ctx context.Context) (int, error) {
	var tli int
	err := p.queryRow(ctx, p.WriterURL(),
		"SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int", nil, &tli)
	if err != nil {
		return 0, fmt.Errorf("read timeline: %w", err)
	}
	return tli, nil
}

// PauseReplication stops the standby's WAL receiver (primary_conninfo
// emptied and reloaded) and returns once it has exited: from then on the
// standby receives nothing. In Sync mode commits on the primary wait until
// ResumeReplication; in async mode they return and are lost if the standby
// is promoted before it catches up.
func (p *Pair) PauseReplication(ctx context.Context) error {
	u := p.standby.URL("postgres")
	if err := p.exec(ctx, u, "ALTER SYSTEM SET primary_conninfo = ''"); err != nil {
		return fmt.Errorf("pause replication: %w", err)
	}
	if err := p.exec(ctx, u, "SELECT pg_reload_conf()"); err != nil {
		return fmt.Errorf("pause replication: %w", err)
	}
	return poll(ctx, "WAL receiver gone", func() (bool, error) {
		var n int
		err := p.queryRow(ctx, u, "SELECT count(*) FROM pg_stat_wal_receiver", nil, &n)
		return n == 0, err
	})
}

// ResumeReplication restores primary_conninfo and waits until the standby
// streams again.
func (p *Pair) ResumeReplication(ctx context.Context) error {
	u := p.standby.URL("postgres")
	if err := p.exec(ctx, u, "ALTER SYSTEM RESET primary_conninfo"); err != nil {
		return fmt.Errorf("resume replication: %w", err)
	}
	if err := p.exec(ctx, u, "SELECT pg_reload_conf()"); err != nil {
		return fmt.Errorf("resume replication: %w", err)
	}
	return p.waitStreaming(ctx)
}

// Close stops both servers and deletes their directories. It is safe to
// call more than once.
func (p *Pair) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()
	// The watchdog stops and removes the clusters when its stdin closes.
	_ = p.watchIn.Close()
	err := p.watchCmd.Wait()
	if rmErr := os.RemoveAll(p.dir); rmErr != nil && err == nil {
		err = rmErr
	}
	if err != nil {
		return fmt.Errorf("stop clusters: %w: %s", err, strings.TrimSpace(p.watchErr.String()))
	}
	return nil
}

// watchdogScript waits for its stdin to close (Close, or the death of the
// process that started it), then stops each cluster immediately and deletes
// the pair's directory. It runs as the server's user, which is what pg_ctl
// needs, and owns that directory.
const watchdogScript = `cat >/dev/null
pg_ctl=$1 dir=$2
for d in "$dir"/primary "$dir"/standby; do
	if [ -f "$d/data/postmaster.pid" ]; then
		"$pg_ctl" stop -D "$d/data" -m immediate -w -t 30 >/dev/null 2>&1
	fi
done
rm -rf "$dir"
`

func (p *Pair) startWatchdog() error {
	bin, err := pglocal.BinDir()
	if err != nil {
		return err
	}
	cmd := exec.Command("/bin/sh", "-c", watchdogScript, "pgha-watchdog", filepath.Join(bin, "pg_ctl"), p.dir)
	// Its own process group: a Ctrl-C to the test must not kill the
	// watchdog before it cleaned up.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if os.Geteuid() == 0 {
		cred, err := pglocal.ServerCredential()
		if err != nil {
			return err
		}
		cmd.SysProcAttr.Credential = cred
		if err := os.Chown(p.dir, int(cred.Uid), int(cred.Gid)); err != nil {
			return fmt.Errorf("watchdog: %w", err)
		}
	}
	cmd.Dir = "/"
	cmd.Stderr = &p.watchErr
	in, err := cmd.StdinPipe()
	if err != nil {
		return fmt.Errorf("watchdog: %w", err)
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start watchdog: %w", err)
	}
	p.watchIn, p.watchCmd = in, cmd
	return nil
}

func (p *Pair) exec(ctx context.Context, url, sql string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	_, err = conn.Exec(ctx, sql)
	return err
}

func (p *Pair) queryRow(ctx context.Context, url, sql string, args []any, dest ...any) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	return conn.QueryRow(ctx, sql, args...).Scan(dest...)
}

// poll calls check every 50 ms until it reports true or ctx ends; the last
// error check returned is part of the timeout's message.
func poll(ctx context.Context, what string, check func() (bool, error)) error {
	var last error
	for {
		ok, err := check()
		if ok {
			return nil
		}
		if err != nil {
			last = err
		}
		select {
		case <-ctx.Done():
			if last != nil {
				return fmt.Errorf("wait for %s: %w (last error: %w)", what, ctx.Err(), last)
			}
			return fmt.Errorf("wait for %s: %w", what, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}
