//go:build linux

package nodeexec

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// cgroupRoot is the cgroup v2 directory the agent owns: the cgroup it was
// started in (a systemd unit's with Delegate=yes). The agent moves itself
// into its leaf cgroupLeaf and runs each command in a cgroup of its own
// beside it, cgroupCmdPrefix plus the command's id.
type cgroupRoot struct {
	dir string // absolute, inside the cgroup2 mount
}

// setupCgroups checks that commands can run in cgroups of their own
// (probeCgroups), removes the command cgroups a previous agent left, and
// moves the agent into its leaf.
func setupCgroups(p cgroupPaths, log *slog.Logger) (*cgroupRoot, error) {
	dir, procs, err := probeCgroups(p)
	if err != nil {
		return nil, err
	}
	r := &cgroupRoot{dir: dir}
	r.removeStale(log)
	// Only when the agent is in that cgroup: a test points the paths at
	// one it is not in.
	if slices.Contains(procs, os.Getpid()) {
		if err := r.enterLeaf(); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// probeCgroups checks that the agent can run commands in cgroups of their
// own below its cgroup, and returns that cgroup's directory and the
// processes in it (the agent alone). It changes nothing but an empty
// probe cgroup it creates and removes.
func probeCgroups(p cgroupPaths) (dir string, procs []int, err error) {
	dir, err = ownCgroup(p.orDefault())
	if err != nil {
		return "", nil, err
	}
	procs, err = readPids(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return "", nil, fmt.Errorf("the agent's cgroup: %w", err)
	}
	var others []int
	for _, pid := range procs {
		if pid != os.Getpid() {
			others = append(others, pid)
		}
	}
	// The agent owns its cgroup only when nothing else runs in it; a
	// shared one (a login session's, a container's with other programs)
	// may hold another agent's commands, which the stale cleanup would
	// kill.
	if len(others) > 0 {
		return "", nil, fmt.Errorf("the agent's cgroup %s holds processes besides the agent (%d, pid %d first), so it is not the agent's own: run leasehold-node as a systemd unit with Delegate=yes, or in a cgroup of its own", dir, len(others), others[0])
	}
	if err := requireDelegated(dir); err != nil {
		return "", nil, err
	}
	if full, err := populated(filepath.Join(dir, cgroupLeaf)); err == nil && full {
		return "", nil, fmt.Errorf("%s/%s holds processes: another leasehold-node owns the cgroup %s", dir, cgroupLeaf, dir)
	}
	probe := filepath.Join(dir, cgroupProbe)
	_ = syscall.Rmdir(probe) // one left by an agent killed while probing
	if err := os.Mkdir(probe, 0o755); err != nil {
		return "", nil, fmt.Errorf("cannot create a cgroup in the agent's cgroup %s: %w", dir, err)
	}
	defer func() { _ = syscall.Rmdir(probe) }()
	if _, err := os.Stat(filepath.Join(probe, "cgroup.kill")); err != nil {
		return "", nil, fmt.Errorf("no cgroup.kill in a new cgroup (it needs Linux 5.14 or later): %w", err)
	}
	if err := probeClone(probe); err != nil {
		return "", nil, fmt.Errorf("cannot start a process in a new cgroup (clone3 with CLONE_INTO_CGROUP, Linux 5.7): %w", err)
	}
	return dir, procs, nil
}

// requireDelegated refuses a systemd unit's cgroup (a name ending in
// .service or .scope) that systemd did not delegate: without Delegate=yes
// systemd owns the cgroups below the unit's too, and cgroup v2 has one
// writer per cgroup. systemd 244 and later mark a delegated cgroup with
// the extended attribute trusted.delegate (and, from 251, user.delegate,
// which needs no privilege to read) set to 1.
func requireDelegated(dir string) error {
	name := filepath.Base(dir)
	if !strings.HasSuffix(name, ".service") && !strings.HasSuffix(name, ".scope") {
		return nil
	}
	buf := make([]byte, 8)
	for _, attr := range []string{"trusted.delegate", "user.delegate"} {
		if n, err := syscall.Getxattr(dir, attr, buf); err == nil && string(buf[:n]) == "1" {
			return nil
		}
	}
	return fmt.Errorf("the agent's cgroup %s is a systemd unit's without Delegate=yes (no trusted.delegate or user.delegate attribute, which systemd 244 and later set on a delegated unit's cgroup): add Delegate=yes to the unit, as deploy/systemd/leasehold-node.service has", dir)
}

// probeClone starts a process directly in cgroup dir, the way commands are
// started. The program cannot exist (a cgroup directory holds no files
// but the kernel's), so the child, once cloned into the cgroup, fails its
// execve with ENOENT and ForkExec reaps it; any other error is the
// clone's.
func probeClone(dir string) error {
	fd, err := syscall.Open(dir, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", dir, err)
	}
	defer func() { _ = syscall.Close(fd) }()
	pid, err := syscall.ForkExec(filepath.Join(dir, "no-such-program"), []string{cgroupProbe},
		&syscall.ProcAttr{Sys: &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: fd}})
	switch {
	case err == nil: // a program there after all: reap it
		var ws syscall.WaitStatus
		_, _ = syscall.Wait4(pid, &ws, 0, nil)
		return nil
	case errors.Is(err, syscall.ENOENT):
		return nil
	}
	return err
}

// ownCgroup is the directory of the agent's cgroup v2: its path from the
// "0::" line of /proc/self/cgroup, below the cgroup2 mount of
// /proc/self/mountinfo (/sys/fs/cgroup on a unified host,
// /sys/fs/cgroup/unified on a hybrid one).
func ownCgroup(p cgroupPaths) (string, error) {
	b, err := os.ReadFile(p.self)
	if err != nil {
		return "", fmt.Errorf("the agent's cgroup: %w", err)
	}
	own, found := "", false
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(strings.TrimRight(line, "\n"), "0::"); ok {
			own, found = rest, true
			break
		}
	}
	if !found || !strings.HasPrefix(own, "/") {
		return "", fmt.Errorf("%s has no cgroup v2 line (\"0::/path\"): the kernel runs cgroup v1 only", p.self)
	}
	b, err = os.ReadFile(p.mountinfo)
	if err != nil {
		return "", fmt.Errorf("cgroup2 mount: %w", err)
	}
	for line := range strings.Lines(string(b)) {
		// id parent major:minor root mountpoint options [optional...] - fstype source superoptions
		f := strings.Fields(line)
		sep := slices.Index(f, "-")
		if sep < 5 || sep+1 >= len(f) || f[sep+1] != "cgroup2" {
			continue
		}
		root, mnt := unescapeMount(f[3]), unescapeMount(f[4])
		var rel string
		switch {
		case root == "/":
			rel = own
		case own == root:
			rel = "/"
		case strings.HasPrefix(own, root+"/"):
			rel = own[len(root):]
		default:
			continue // a mount of another part of the hierarchy
		}
		return filepath.Join(mnt, rel), nil
	}
	return "", fmt.Errorf("no cgroup2 filesystem in %s holds the agent's cgroup %s: cgroup v2 is not mounted", p.mountinfo, own)
}

// enterLeaf moves the agent into its leaf cgroup. cgroup v2 lets a cgroup
// hand controllers to its children only while no process is in it (the
// "no internal processes" rule), and systemd's delegation documentation
// asks a program with Delegate=yes to treat its unit's cgroup as such an
// inner node: the agent leaves it before any command starts beside it, so
// that controllers can be enabled for the commands' cgroups.
func (r *cgroupRoot) enterLeaf() error {
	leaf := filepath.Join(r.dir, cgroupLeaf)
	if err := os.Mkdir(leaf, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("create the agent's cgroup %s: %w", leaf, err)
	}
	if err := writeCgroupFile(filepath.Join(leaf, "cgroup.procs"), strconv.Itoa(os.Getpid())); err != nil {
		return fmt.Errorf("move the agent into %s: %w", leaf, err)
	}
	return nil
}

// removeStale kills and removes the command cgroups an agent left when it
// was killed (SIGKILL, a crash) while its commands ran: those commands
// were reported as stopped with the agent.
func (r *cgroupRoot) removeStale(log *slog.Logger) {
	entries, err := os.ReadDir(r.dir)
	if err != nil {
		log.Warn("cannot list the agent's cgroup for cgroups left by a previous agent", "cgroup", r.dir, "err", err)
		return
	}
	for _, ent := range entries {
		if !ent.IsDir() || !strings.HasPrefix(ent.Name(), cgroupCmdPrefix) {
			continue
		}
		c := &cmdCgroup{dir: filepath.Join(r.dir, ent.Name()), fd: -1}
		pids := c.pids()
		if err := c.remove(cgroupSettle); err != nil {
			log.Warn("cannot remove a command's cgroup left by a previous agent", "cgroup", c.dir, "err", err)
			continue
		}
		log.Info("removed a command's cgroup left by a previous agent", "cgroup", c.dir, "killed", len(pids))
	}
}

// create makes the cgroup of command id and opens it for clone3.
func (r *cgroupRoot) create(id string) (*cmdCgroup, error) {
	base := cgroupName(id)
	name := base
	for i := 1; ; i++ {
		err := os.Mkdir(filepath.Join(r.dir, name), 0o755)
		if err == nil {
			break
		}
		if !errors.Is(err, fs.ErrExist) || i > 100 {
			return nil, fmt.Errorf("create the command's cgroup %s: %w", filepath.Join(r.dir, name), err)
		}
		// Another command whose id reads the same once sanitised, or a
		// cgroup that could not be removed (a process stuck in
		// uninterruptible sleep).
		name = base + "." + strconv.Itoa(i)
	}
	dir := filepath.Join(r.dir, name)
	fd, err := syscall.Open(dir, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
	if err != nil {
		_ = syscall.Rmdir(dir)
		return nil, fmt.Errorf("open the command's cgroup %s: %w", dir, err)
	}
	return &cmdCgroup{dir: dir, fd: fd}, nil
}

// cmdCgroup is one command's cgroup.
type cmdCgroup struct {
	dir string
	fd  int // open for clone3 until the process started; -1 after
}

// setProcAttr makes the process start in the cgroup: clone3 with
// CLONE_INTO_CGROUP, so the child never runs outside it.
func (c *cmdCgroup) setProcAttr(a *syscall.SysProcAttr) {
	a.UseCgroupFD, a.CgroupFD = true, c.fd
}

// closeFD closes the descriptor clone3 needed.
func (c *cmdCgroup) closeFD() {
	if c.fd >= 0 {
		_ = syscall.Close(c.fd)
		c.fd = -1
	}
}

// kill sends SIGKILL to every process in the cgroup and below it, those
// that left the command's process group and session (setsid) too.
func (c *cmdCgroup) kill() error {
	return writeCgroupFile(filepath.Join(c.dir, "cgroup.kill"), "1")
}

// populated reports whether a process is alive in the cgroup or below it
// (an unreaped zombie is not).
func (c *cmdCgroup) populated() (bool, error) { return populated(c.dir) }

// signalOutsideGroup sends sig to each process in the cgroup (and below)
// that is not in process group pgid, which the caller signals as a whole:
// the ones that left it (setsid) get their SIGTERM and their grace too,
// and none gets the signal twice. A pid read from cgroup.procs could in
// theory exit and be reused before the signal; the kernel hands pids out
// in turn, so that needs the whole pid space to wrap within microseconds.
func (c *cmdCgroup) signalOutsideGroup(pgid int, sig syscall.Signal) {
	for _, pid := range c.pids() {
		if _, _, pgrp, ok := procStat(pid); ok && pgrp == pgid {
			continue
		}
		_ = syscall.Kill(pid, sig)
	}
}

// pids lists the processes in the cgroup and below it.
func (c *cmdCgroup) pids() []int {
	var out []int
	_ = filepath.WalkDir(c.dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil // a cgroup removed while walking holds no process
		}
		pids, _ := readPids(filepath.Join(path, "cgroup.procs"))
		out = append(out, pids...)
		return nil
	})
	return out
}

// waitEmpty waits until no process is alive in the cgroup, for at most
// limit. It polls cgroup.events: the wait is short (a killed cgroup
// empties in milliseconds) and usually over at the first read, where an
// inotify watch would cost a descriptor and a reader per command; the
// limit keeps a process in uninterruptible sleep from holding the command
// forever.
func (c *cmdCgroup) waitEmpty(limit time.Duration) bool {
	deadline := time.Now().Add(limit)
	for {
		full, err := c.populated()
		if err != nil || !full {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// remove kills what is left in the cgroup, waits up to limit for it to
// empty, and removes it with any cgroup the command made inside it.
func (c *cmdCgroup) remove(limit time.Duration) error {
	c.closeFD()
	if full, err := c.populated(); err == nil && full {
		if err := c.kill(); err != nil {
			return fmt.Errorf("kill the processes of cgroup %s: %w", c.dir, err)
		}
		if !c.waitEmpty(limit) {
			return fmt.Errorf("processes of cgroup %s survive SIGKILL for %s (uninterruptible sleep?); the next start of the agent removes it", c.dir, limit)
		}
	}
	if err := removeCgroupTree(c.dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove cgroup %s: %w", c.dir, err)
	}
	return nil
}

// removeCgroupTree removes cgroup dir after its children, deepest first
// (rmdir: a cgroup's files are the kernel's and go with it).
func removeCgroupTree(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, ent := range entries {
		if ent.IsDir() {
			if err := removeCgroupTree(filepath.Join(dir, ent.Name())); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return err
			}
		}
	}
	return syscall.Rmdir(dir)
}

// populated reads the "populated" key of cgroup dir's cgroup.events.
func populated(dir string) (bool, error) {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.events"))
	if err != nil {
		return false, err
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "populated "); ok {
			return v != "0", nil
		}
	}
	return false, fmt.Errorf("%s/cgroup.events has no populated key", dir)
}

// readPids reads a cgroup.procs file.
func readPids(file string) ([]int, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var out []int
	for _, f := range bytes.Fields(b) {
		if pid, err := strconv.Atoi(string(f)); err == nil {
			out = append(out, pid)
		}
	}
	return out, nil
}

// writeCgroupFile writes s to a cgroup interface file, which must exist.
func writeCgroupFile(file, s string) error {
	f, err := os.OpenFile(file, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(s)
	return errors.Join(err, f.Close())
}
