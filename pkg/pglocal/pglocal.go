// Package pglocal runs a PostgreSQL cluster from the machine's own PostgreSQL
// binaries (initdb, pg_ctl): the development stack's embedded default under
// .dev/ and the test harness's throwaway clusters.
//
// When the process runs as root, as CI does, the server runs as the
// unprivileged "postgres" user (or "nobody"), because PostgreSQL refuses to
// run as root.
package pglocal

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// ErrNoBinaries reports that no initdb/pg_ctl was found.
var ErrNoBinaries = errors.New("PostgreSQL server binaries (initdb, pg_ctl) not found: install them with `sudo apt-get install -y postgresql` or set LEASEHOLD_DATABASE_URL")

// Options configures a cluster.
type Options struct {
	// Dir is the cluster's directory; the data directory is Dir/data and the
	// socket and log live beside it. Created when missing.
	Dir string
	// Port is the TCP port on 127.0.0.1; 0 picks a free one (kept in Dir/port
	// so a restarted dev cluster keeps its port).
	Port int
	// Settings are extra postgresql.conf lines (name -> value) written at init.
	Settings map[string]string
	// Durable false turns fsync and synchronous_commit off: for tests only.
	Durable bool
	// Listen are addresses the server listens on besides 127.0.0.1 (they
	// must exist when it starts), and HostAuth the client networks (CIDR)
	// allowed to log in from them with a password: for tests that reach the
	// server from a network namespace (pkg/netns).
	Listen, HostAuth []string
}

// Cluster is a local PostgreSQL cluster managed with pg_ctl.
type Cluster struct {
	opts   Options
	binDir string
	cred   *syscall.Credential
}

// BinDir finds the directory holding initdb and pg_ctl: $PATH first, then
// the newest /usr/lib/postgresql/<major>/bin.
func BinDir() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real
		}
		return filepath.Dir(p), nil
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return majorOf(dirs[i]) > majorOf(dirs[j]) })
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	return "", ErrNoBinaries
}

func majorOf(binDir string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return n
}

// New prepares a cluster in opts.Dir, running initdb when the data directory
// does not exist yet. It does not start the server.
func New(ctx context.Context, opts Options) (*Cluster, error) {
	bin, err := BinDir()
	if err != nil {
		return nil, err
	}
	dir, err := filepath.Abs(opts.Dir)
	if err != nil {
		return nil, fmt.Errorf("cluster dir: %w", err)
	}
	opts.Dir = dir
	c := &Cluster{opts: opts, binDir: bin}
	if os.Geteuid() == 0 {
		if c.cred, err = ServerCredential(); err != nil {
			return nil, err
		}
	}
	// Parents must stay traversable by the server's user when we run as root.
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return nil, fmt.Errorf("create cluster parent dir: %w", err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create cluster dir: %w", err)
	}
	if err := c.chown(dir); err != nil {
		return nil, err
	}
	if c.opts.Port == 0 {
		c.opts.Port = c.savedPort()
	}
	if c.opts.Port == 0 {
		if c.opts.Port, err = FreePort(); err != nil {
			return nil, err
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "port"), []byte(strconv.Itoa(c.opts.Port)), 0o644); err != nil {
		return nil, fmt.Errorf("save port: %w", err)
	}
	if _, err := os.Stat(filepath.Join(c.DataDir(), "PG_VERSION")); err == nil {
		return c, nil
	}
	if err := c.initdb(ctx); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *Cluster) savedPort() int {
	b, err := os.ReadFile(filepath.Join(c.opts.Dir, "port"))
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return n
}

// ServerCredential returns the unprivileged user ("postgres", else "nobody")
// that PostgreSQL and PgBouncer run as when this process is root: both
// refuse to run as root.
func ServerCredential() (*syscall.Credential, error) {
	for _, name := range []string{"postgres", "nobody"} {
		u, err := user.Lookup(name)
		if err != nil {
			continue
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
	}
	return nil, errors.New("running as root and no unprivileged user (postgres, nobody) to run PostgreSQL as")
}

func (c *Cluster) chown(path string) error {
	if c.cred == nil {
		return nil
	}
	if err := os.Chown(path, int(c.cred.Uid), int(c.cred.Gid)); err != nil {
		return fmt.Errorf("chown %s: %w", path, err)
	}
	return nil
}

func (c *Cluster) initdb(ctx context.Context) error {
	pwfile := filepath.Join(c.opts.Dir, "initdb.pw")
	if err := os.WriteFile(pwfile, []byte("postgres\n"), 0o600); err != nil {
		return err
	}
	defer os.Remove(pwfile)
	if err := c.chown(pwfile); err != nil {
		return err
	}
	if _, err := c.run(ctx, "initdb", "-D", c.DataDir(), "-U", "postgres", "--pwfile", pwfile,
		"--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C", "--no-instructions"); err != nil {
		return err
	}
	settings := map[string]string{
		"listen_addresses":         quoteConf(strings.Join(append([]string{"127.0.0.1"}, c.opts.Listen...), ",")),
		"unix_socket_directories":  "'" + c.opts.Dir + "'",
		"max_connections":          "400",
		"shared_buffers":           "'128MB'",
		"shared_preload_libraries": "'pg_stat_statements'",
		"log_min_messages":         "warning",
		"log_line_prefix":          "'%m [%p] %q%u@%d '",
	}
	if !c.opts.Durable {
		settings["fsync"] = "off"
		settings["synchronous_commit"] = "off"
		settings["full_page_writes"] = "off"
	}
	for k, v := range c.opts.Settings {
		settings[k] = v
	}
	if err := c.allowHosts(); err != nil {
		return err
	}
	var buf bytes.Buffer
	buf.WriteString("\n# leasehold pglocal\n")
	keys := make([]string, 0, len(settings))
	for k := range settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(&buf, "%s = %s\n", k, settings[k])
	}
	f, err := os.OpenFile(filepath.Join(c.DataDir(), "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("append postgresql.conf: %w", err)
	}
	defer f.Close()
	if _, err := f.Write(buf.Bytes()); err != nil {
		return fmt.Errorf("append postgresql.conf: %w", err)
	}
	return nil
}

// allowHosts appends a password login line to pg_hba.conf for each of
// opts.HostAuth.
func (c *Cluster) allowHosts() error {
	if len(c.opts.HostAuth) == 0 {
		return nil
	}
	var buf bytes.Buffer
	buf.WriteString("\n# leasehold pglocal: networks allowed besides loopback\n")
	for _, cidr := range c.opts.HostAuth {
		if _, _, err := net.ParseCIDR(cidr); err != nil {
			return fmt.Errorf("pglocal: HostAuth %q: %w", cidr, err)
		}
		fmt.Fprintf(&buf, "host all all %s scram-sha-256\n", cidr)
	}
	f, err := os.OpenFile(filepath.Join(c.DataDir(), "pg_hba.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("append pg_hba.conf: %w", err)
	}
	defer f.Close()
	if _, err := f.Write(buf.Bytes()); err != nil {
		return fmt.Errorf("append pg_hba.conf: %w", err)
	}
	return nil
}

// DataDir is the cluster's PGDATA.
func (c *Cluster) DataDir() string { return filepath.Join(c.opts.Dir, "data") }

// Port is the server's TCP port on 127.0.0.1.
func (c *Cluster) Port() int { return c.opts.Port }

// LogFile is the server log written by pg_ctl.
func (c *Cluster) LogFile() string { return filepath.Join(c.opts.Dir, "postgres.log") }

// URL is a connection URL for database db as the superuser over TCP.
func (c *Cluster) URL(db string) string {
	return fmt.Sprintf("postgres://postgres:postgres@127.0.0.1:%d/%s?sslmode=disable", c.opts.Port, db)
}

// Running reports whether pg_ctl sees a running server.
func (c *Cluster) Running(ctx context.Context) bool {
	_, err := c.run(ctx, "pg_ctl", "status", "-D", c.DataDir())
	return err == nil
}

// Start starts the server and waits until it accepts connections. Starting a
// running cluster is a no-op.
func (c *Cluster) Start(ctx context.Context) error {
	if c.Running(ctx) {
		return nil
	}
	if err := c.touch(c.LogFile()); err != nil {
		return err
	}
	_, err := c.run(ctx, "pg_ctl", "start", "-w", "-t", "60", "-D", c.DataDir(), "-l", c.LogFile(),
		"-o", "-p "+strconv.Itoa(c.opts.Port))
	if err != nil {
		return fmt.Errorf("%w (server log: %s)", err, c.LogFile())
	}
	return nil
}

func (c *Cluster) touch(path string) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	f.Close()
	return c.chown(path)
}

// StopMode is pg_ctl's shutdown mode.
type StopMode string

// Shutdown modes of pg_ctl stop.
const (
	StopSmart     StopMode = "smart"
	StopFast      StopMode = "fast"
	StopImmediate StopMode = "immediate"
)

// Stop stops the server in the given mode and waits for it to exit.
func (c *Cluster) Stop(ctx context.Context, mode StopMode) error {
	if !c.Running(ctx) {
		return nil
	}
	_, err := c.run(ctx, "pg_ctl", "stop", "-w", "-t", "60", "-D", c.DataDir(), "-m", string(mode))
	return err
}

// Restart stops the server in mode and starts it again.
func (c *Cluster) Restart(ctx context.Context, mode StopMode) error {
	if err := c.Stop(ctx, mode); err != nil {
		return err
	}
	return c.Start(ctx)
}

// Remove stops the server immediately and deletes the cluster directory.
func (c *Cluster) Remove(ctx context.Context) error {
	_ = c.Stop(ctx, StopImmediate)
	return os.RemoveAll(c.opts.Dir)
}

func (c *Cluster) run(ctx context.Context, prog string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, filepath.Join(c.binDir, prog), args...)
	cmd.Dir = c.opts.Dir
	cmd.Env = append(os.Environ(), "LC_ALL=C")
	if c.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred}
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("%s %s: %w: %s", prog, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return out, nil
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// WaitTCP waits until addr accepts TCP connections or the timeout passes.
func WaitTCP(addr string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		conn, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err == nil {
			conn.Close()
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("wait for %s: %w", addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
