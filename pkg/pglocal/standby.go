package pglocal

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// NewStandby makes a streaming-replication standby of the running primary
// in opts.Dir with pg_basebackup: a copy of the primary's data directory,
// standby.signal, and primary_conninfo naming the primary over TCP with
// application_name appName (what synchronous_standby_names matches) and the
// physical replication slot slot, created on the primary when missing.
// opts.Settings are appended to the copied postgresql.conf after the
// standby's own socket directory, so they win. It does not start the server.
func NewStandby(ctx context.Context, primary *Cluster, opts Options, appName, slot string) (*Cluster, error) {
	bin, err := BinDir()
	if err != nil {
		return nil, err
	}
	dir, err := filepath.Abs(opts.Dir)
	if err != nil {
		return nil, fmt.Errorf("standby dir: %w", err)
	}
	opts.Dir = dir
	c := &Cluster{opts: opts, binDir: bin}
	if os.Geteuid() == 0 {
		if c.cred, err = ServerCredential(); err != nil {
			return nil, err
		}
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return nil, fmt.Errorf("create standby parent dir: %w", err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create standby dir: %w", err)
	}
	if err := c.chown(dir); err != nil {
		return nil, err
	}
	if c.opts.Port == 0 {
		if c.opts.Port, err = FreePort(); err != nil {
			return nil, err
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "port"), []byte(strconv.Itoa(c.opts.Port)), 0o644); err != nil {
		return nil, fmt.Errorf("save port: %w", err)
	}
	conninfo := fmt.Sprintf("host=127.0.0.1 port=%d user=postgres password=postgres application_name=%s", primary.Port(), appName)
	// Over the primary's unix socket (trust), as the server's user; -C -S
	// creates the slot so the primary keeps the WAL the standby still needs.
	args := []string{"-h", primary.opts.Dir, "-p", strconv.Itoa(primary.Port()), "-U", "postgres",
		"-D", c.DataDir(), "-X", "stream", "-c", "fast", "--no-sync"}
	if slot != "" {
		args = append(args, "-S", slot)
		if !primary.hasSlot(ctx, slot) {
			args = append(args, "-C")
		}
	}
	if _, err := c.run(ctx, "pg_basebackup", args...); err != nil {
		return nil, err
	}
	settings := map[string]string{
		"unix_socket_directories": "'" + dir + "'",
		"primary_conninfo":        quoteConf(conninfo),
		"hot_standby":             "on",
	}
	if slot != "" {
		settings["primary_slot_name"] = quoteConf(slot)
	}
	for k, v := range opts.Settings {
		settings[k] = v
	}
	if err := c.AppendConf(settings); err != nil {
		return nil, err
	}
	signal := filepath.Join(c.DataDir(), "standby.signal")
	if err := os.WriteFile(signal, nil, 0o600); err != nil {
		return nil, fmt.Errorf("write standby.signal: %w", err)
	}
	if err := c.chown(signal); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *Cluster) hasSlot(ctx context.Context, slot string) bool {
	out, err := c.run(ctx, "psql", "-h", c.opts.Dir, "-p", strconv.Itoa(c.Port()), "-U", "postgres", "-d", "postgres",
		"-Atc", "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '"+strings.ReplaceAll(slot, "'", "''")+"'")
	return err == nil && strings.TrimSpace(string(out)) == "1"
}

func quoteConf(v string) string { return "'" + strings.ReplaceAll(v, "'", "''") + "'" }

// AppendConf appends settings (name -> already quoted value) to
// postgresql.conf; later lines win, so they override what initdb or a base
// backup wrote. They take effect at the next start (or reload, for settings
// that allow it).
func (c *Cluster) AppendConf(settings map[string]string) error {
	keys := make([]string, 0, len(settings))
	for k := range settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var buf bytes.Buffer
	buf.WriteString("\n# leasehold pglocal (appended)\n")
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

// Promote ends recovery on a standby (pg_ctl promote) and waits until it
// runs as a primary.
func (c *Cluster) Promote(ctx context.Context) error {
	_, err := c.run(ctx, "pg_ctl", "promote", "-w", "-t", "60", "-D", c.DataDir())
	return err
}

// PostmasterPID is the running postmaster's pid, from postmaster.pid.
func (c *Cluster) PostmasterPID() (int, error) {
	b, err := os.ReadFile(filepath.Join(c.DataDir(), "postmaster.pid"))
	if err != nil {
		return 0, fmt.Errorf("read postmaster.pid: %w", err)
	}
	line, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("postmaster.pid: bad pid %q", line)
	}
	return pid, nil
}

// Kill crashes the server the way a lost host does: the postmaster and every
// one of its processes get SIGKILL at once, with no shutdown checkpoint and
// no goodbye to clients or standbys. It returns when all of them are gone, so
// Start can follow (the server then runs crash recovery). Killing a stopped
// server is a no-op.
func (c *Cluster) Kill(ctx context.Context) error {
	pid, err := c.PostmasterPID()
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	// Freeze the postmaster so it forks nothing while its children are
	// listed, then kill them all.
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		if errors.Is(err, syscall.ESRCH) {
			return nil
		}
		return fmt.Errorf("stop postmaster %d: %w", pid, err)
	}
	pids := append(childrenOf(pid), pid)
	for _, p := range pids {
		_ = syscall.Kill(p, syscall.SIGKILL)
	}
	for {
		alive := 0
		for _, p := range pids {
			if processAlive(p) {
				alive++
			}
		}
		if alive == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for %d killed server processes to exit: %w", alive, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// childrenOf lists the processes whose parent is pid, from /proc.
func childrenOf(pid int) []int {
	entries, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range entries {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ppid, _, ok := procStat(p); ok && ppid == pid {
			out = append(out, p)
		}
	}
	return out
}

// processAlive reports whether pid exists and is not a zombie.
func processAlive(pid int) bool {
	_, state, ok := procStat(pid)
	return ok && state != 'Z' && state != 'X'
}

// procStat reads the parent pid and state of pid from /proc/<pid>/stat.
func procStat(pid int) (ppid int, state byte, ok bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0, false
	}
	// pid (comm) state ppid ...; comm may hold spaces and parentheses.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 2 || len(f[0]) != 1 {
		return 0, 0, false
	}
	ppid, err = strconv.Atoi(f[1])
	if err != nil {
		return 0, 0, false
	}
	return ppid, f[0][0], true
}
