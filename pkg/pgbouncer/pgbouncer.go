// Package pgbouncer runs a real PgBouncer process in transaction mode in
// front of a PostgreSQL server, for tests that prove leasehold is safe behind
// a transaction pooler (docs/design.md#tests).
//
// Every database of the server is reachable through one wildcard entry
// (`* = host=… port=…`), so databases created after the start (one per test)
// need no reload. Clients authenticate with SCRAM against a userlist holding
// the server's superuser; PgBouncer logs in to the server with the same
// credentials. When the caller runs as root, PgBouncer (which refuses root)
// runs as the "postgres" user, like pkg/pglocal's server.
package pgbouncer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/leasehold/leasehold/pkg/pglocal"
)

// ErrNoBinary reports that no pgbouncer executable was found.
var ErrNoBinary = errors.New("pgbouncer not found: install it with `apt-get install -y pgbouncer`")

// Options configures a PgBouncer in front of one server.
type Options struct {
	// ServerHost and ServerPort address the PostgreSQL server.
	ServerHost string
	ServerPort int
	// User and Password are the credentials clients use and PgBouncer
	// forwards to the server.
	User, Password string
	// PoolSize is default_pool_size: server connections per (database,
	// user) pair (default 20).
	PoolSize int
	// MaxUserConns caps server connections of User across every database
	// (default 300), below the server's max_connections.
	MaxUserConns int
	// MaxClientConn is max_client_conn (default 2000).
	MaxClientConn int
	// Port is the loopback listen port; 0 picks a free one.
	Port int
}

// Bouncer is a running PgBouncer.
type Bouncer struct {
	mu   sync.Mutex // guards opts' server address across Repoint
	opts Options
	dir  string
	cmd  *exec.Cmd
	logs *syncBuffer
	done chan struct{}
	err  error
}

// Binary finds the pgbouncer executable in $PATH or /usr/sbin.
func Binary() (string, error) {
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/sbin/pgbouncer", "/usr/local/sbin/pgbouncer", "/usr/local/bin/pgbouncer"} {
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", ErrNoBinary
}

// Start writes a configuration under a temporary directory, starts
// PgBouncer and waits until it accepts connections.
func Start(ctx context.Context, opts Options) (*Bouncer, error) {
	bin, err := Binary()
	if err != nil {
		return nil, err
	}
	if opts.ServerHost == "" || opts.ServerPort == 0 || opts.User == "" {
		return nil, errors.New("pgbouncer: server host, port and user are required")
	}
	if opts.PoolSize == 0 {
		opts.PoolSize = 20
	}
	if opts.MaxUserConns == 0 {
		opts.MaxUserConns = 300
	}
	if opts.MaxClientConn == 0 {
		opts.MaxClientConn = 2000
	}
	if opts.Port == 0 {
		if opts.Port, err = pglocal.FreePort(); err != nil {
			return nil, err
		}
	}
	dir, err := os.MkdirTemp("", "leasehold-pgbouncer-")
	if err != nil {
		return nil, fmt.Errorf("pgbouncer: temp dir: %w", err)
	}
	b := &Bouncer{opts: opts, dir: dir, logs: &syncBuffer{}, done: make(chan struct{})}
	ini := b.iniPath()
	users := b.userlistPath()
	if err := os.WriteFile(ini, []byte(b.config(users)), 0o600); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("pgbouncer: write config: %w", err)
	}
	if err := os.WriteFile(users, []byte(fmt.Sprintf("%q %q\n", opts.User, opts.Password)), 0o600); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("pgbouncer: write userlist: %w", err)
	}
	// With no logfile PgBouncer logs to stderr, which we keep for failures.
	b.cmd = exec.Command(bin, ini)
	b.cmd.Stdout, b.cmd.Stderr = b.logs, b.logs
	// The test binary may die without running cleanups: take PgBouncer down
	// with it rather than leaving it listening.
	b.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if os.Geteuid() == 0 {
		cred, err := pglocal.ServerCredential()
		if err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
		for _, p := range []string{dir, ini, users} {
			if err := os.Chown(p, int(cred.Uid), int(cred.Gid)); err != nil {
				os.RemoveAll(dir)
				return nil, fmt.Errorf("pgbouncer: chown %s: %w", p, err)
			}
		}
		b.cmd.SysProcAttr.Credential = cred
	}
	if err := b.cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("pgbouncer: start: %w", err)
	}
	go func() {
		b.err = b.cmd.Wait()
		close(b.done)
	}()
	deadline := time.Now().Add(15 * time.Second)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	for {
		select {
		case <-b.done:
			os.RemoveAll(dir)
			return nil, fmt.Errorf("pgbouncer exited at start: %w\n%s", b.err, b.logs.String())
		default:
		}
		if err := pglocal.WaitTCP(b.Addr(), 100*time.Millisecond); err == nil {
			return b, nil
		}
		if time.Now().After(deadline) {
			b.Stop()
			return nil, fmt.Errorf("pgbouncer did not listen on %s: %s", b.Addr(), b.logs.String())
		}
	}
}

func (b *Bouncer) config(userlist string) string {
	o := b.opts
	return fmt.Sprintf(`[databases]
* = host=%s port=%d

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
pidfile =
logfile =
auth_type = scram-sha-256
auth_file = %s
admin_users = %s
pool_mode = transaction
default_pool_size = %d
min_pool_size = 0
reserve_pool_size = 0
max_client_conn = %d
max_user_connections = %d
server_idle_timeout = 10
server_lifetime = 300
server_connect_timeout = 5
server_login_retry = 1
query_wait_timeout = 60
ignore_startup_parameters = extra_float_digits,search_path
server_tls_sslmode = disable
log_connections = 0
log_disconnections = 0
log_pooler_errors = 1
`, o.ServerHost, o.ServerPort, o.Port, userlist, o.User, o.PoolSize, o.MaxClientConn, o.MaxUserConns)
}

// Port is PgBouncer's listen port on 127.0.0.1.
func (b *Bouncer) Port() int { return b.opts.Port }

// Addr is PgBouncer's host:port.
func (b *Bouncer) Addr() string { return "127.0.0.1:" + strconv.Itoa(b.opts.Port) }

// URL is a connection URL for database db through PgBouncer. It carries
// pgx's settings for a transaction pooler (exec mode, no statement or
// description cache), so any pgx client on it — a pool, a single
// connection, database/sql — keeps no prepared statement across
// transactions.
func (b *Bouncer) URL(db string) string {
	u := url.URL{
		Scheme: "postgres",
		User:   url.UserPassword(b.opts.User, b.opts.Password),
		Host:   b.Addr(),
		Path:   "/" + db,
	}
	q := url.Values{}
	q.Set("sslmode", "disable")
	q.Set("default_query_exec_mode", "exec")
	q.Set("statement_cache_capacity", "0")
	q.Set("description_cache_capacity", "0")
	u.RawQuery = q.Encode()
	return u.String()
}

// Logs returns what PgBouncer wrote so far.
func (b *Bouncer) Logs() string { return b.logs.String() }

// Stop kills PgBouncer and removes its directory.
func (b *Bouncer) Stop() {
	if b.cmd != nil && b.cmd.Process != nil {
		_ = b.cmd.Process.Kill()
		<-b.done
	}
	os.RemoveAll(b.dir)
}

type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.String()
}
