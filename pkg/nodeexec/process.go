package nodeexec

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/leasehold/leasehold/pkg/cmdkind"
	"github.com/leasehold/leasehold/pkg/daemon"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// runSpec is one process to run: exec's payload, or script's interpreter
// with the script's path.
type runSpec struct {
	id       string // the command's: names its cgroup
	argv     []string
	env      map[string]string
	dir      string
	user     string
	group    string
	stdin    []byte
	timeout  time.Duration // 0: none but the deadline
	deadline time.Time     // zero: none
	// prepare runs once the identity is known, before the process starts
	// (script: write the script where that user can read it).
	prepare func(id identity) error
}

// identity is who a process runs as.
type identity struct {
	name, home string
	uid, gid   uint32
	groups     []uint32
	// cred is nil when the process runs as the agent itself.
	cred *syscall.Credential
}

// basePath is PATH when the agent has none.
const basePath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// lookupUser looks up a user by name or numeric id; "" is the agent's
// own. One the node does not have is CodeUserNotFound.
func lookupUser(ref string) (identity, error) {
	var (
		u   *user.User
		err error
	)
	switch {
	case ref == "":
		u, err = user.LookupId(strconv.Itoa(os.Geteuid()))
		if err != nil {
			// The agent's own uid without a passwd entry (a container):
			// run as it, with what the environment says.
			u = &user.User{Uid: strconv.Itoa(os.Geteuid()), Gid: strconv.Itoa(os.Getegid()), Username: os.Getenv("USER"), HomeDir: os.Getenv("HOME")}
			err = nil
		}
	case cmdkind.IsNumericID(ref):
		u, err = user.LookupId(ref)
	default:
		u, err = user.Lookup(ref)
	}
	if err != nil {
		return identity{}, coded(CodeUserNotFound, "user %q: %v", ref, err)
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err1 != nil || err2 != nil {
		return identity{}, coded(CodeUserNotFound, "user %q has a non-numeric uid %q or gid %q", ref, u.Uid, u.Gid)
	}
	id := identity{name: u.Username, home: u.HomeDir, uid: uint32(uid), gid: uint32(gid)}
	if ref != "" {
		// The user's supplementary groups, as a login would have them.
		if gids, err := u.GroupIds(); err == nil {
			for _, s := range gids {
				if g, err := strconv.ParseUint(s, 10, 32); err == nil {
					id.groups = append(id.groups, uint32(g))
				}
			}
		}
	}
	return id, nil
}

// resolveIdentity looks up who a command runs as. A user or group the node
// does not have is CodeUserNotFound or CodeGroupNotFound; running as
// another user or group needs root, and says so.
func resolveIdentity(userRef, groupRef string) (identity, error) {
	id, err := lookupUser(userRef)
	if err != nil {
		return identity{}, err
	}
	if groupRef != "" {
		g, err := lookupGroup(groupRef)
		if err != nil {
			return identity{}, err
		}
		id.gid = g
	}
	switching := userRef != "" && id.uid != uint32(os.Geteuid()) || groupRef != "" && id.gid != uint32(os.Getegid())
	if !switching {
		return id, nil
	}
	if os.Geteuid() != 0 {
		return identity{}, coded(CodePermissionDenied, "running as user %q group %q needs leasehold-node to run as root; it runs as uid %d",
			userRef, groupRef, os.Geteuid())
	}
	id.cred = &syscall.Credential{Uid: id.uid, Gid: id.gid, Groups: id.groups, NoSetGroups: userRef == ""}
	return id, nil
}

func lookupGroup(ref string) (uint32, error) {
	var (
		g   *user.Group
		err error
	)
	if cmdkind.IsNumericID(ref) {
		g, err = user.LookupGroupId(ref)
	} else {
		g, err = user.LookupGroup(ref)
	}
	if err != nil {
		return 0, coded(CodeGroupNotFound, "group %q: %v", ref, err)
	}
	n, err := strconv.ParseUint(g.Gid, 10, 32)
	if err != nil {
		return 0, coded(CodeGroupNotFound, "group %q has a non-numeric gid %q", ref, g.Gid)
	}
	return uint32(n), nil
}

// environ is the base environment for id, then env on top.
func environ(id identity, env map[string]string) []string {
	base := map[string]string{"PATH": os.Getenv("PATH"), "LANG": os.Getenv("LANG"), "HOME": id.home, "USER": id.name, "LOGNAME": id.name}
	if base["PATH"] == "" {
		base["PATH"] = basePath
	}
	if base["LANG"] == "" {
		base["LANG"] = "C.UTF-8"
	}
	if base["HOME"] == "" {
		base["HOME"] = "/"
	}
	out := make([]string, 0, len(base)+len(env))
	for k, v := range base {
		if _, set := env[k]; !set {
			out = append(out, k+"="+v)
		}
	}
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	return out
}

// runScript writes the script to a private directory, runs it with its
// interpreter, and removes the directory.
func (e *Executor) runScript(ctx context.Context, log *slog.Logger, id string, p *nodev1.ScriptPayload, deadline time.Time) daemon.Outcome {
	dir, err := os.MkdirTemp("", "leasehold-script-")
	if err != nil {
		return failf(CodeIOError, "script: create its directory: %v", err)
	}
	defer func() {
		if err := os.RemoveAll(dir); err != nil {
			log.Warn("script: remove its directory", "dir", dir, "err", err)
		}
	}()
	path := filepath.Join(dir, "script")
	spec := runSpec{id: id, argv: append([]string{p.GetInterpreter(), path}, p.GetArgs()...), env: p.GetEnv(), dir: p.GetDir(),
		user: p.GetUser(), group: p.GetGroup(), timeout: p.GetTimeout().AsDuration(), deadline: deadline}
	spec.prepare = func(who identity) error {
		if err := os.WriteFile(path, []byte(p.GetScript()), 0o700); err != nil {
			return fmt.Errorf("script: write %s: %w", path, err)
		}
		if who.cred != nil {
			// Private to the user it runs as, not world-readable.
			for _, f := range []string{dir, path} {
				if err := os.Chown(f, int(who.uid), int(who.gid)); err != nil {
					return fmt.Errorf("script: chown %s: %w", f, err)
				}
			}
		}
		return nil
	}
	return e.runProcess(ctx, log, spec)
}

// stopReason is why the executor signalled a process group.
type stopReason int

const (
	stopNone stopReason = iota
	stopCancel
	stopTimeout
)

// runProcess runs spec in a process group of its own, and in a cgroup of
// its own when the executor has cgroups, and reports how it ended. It
// waits for a slot first.
func (e *Executor) runProcess(ctx context.Context, log *slog.Logger, spec runSpec) daemon.Outcome {
	// A command waits for a slot until its deadline at most; its own
	// timeout counts from when it starts.
	queueCtx, cancelQueue := ctx, context.CancelFunc(func() {})
	if !spec.deadline.IsZero() {
		queueCtx, cancelQueue = context.WithDeadline(ctx, spec.deadline)
	}
	defer cancelQueue()
	select {
	case e.slots <- struct{}{}:
	case <-queueCtx.Done():
		if ctx.Err() != nil {
			return daemon.Outcome{ExitCode: -1, Err: "cancelled before it started"}
		}
		return daemon.Outcome{ExitCode: -1, Err: fmt.Sprintf("deadline passed before it started (waiting for one of the %d running commands to end)", cap(e.slots))}
	}
	defer func() { <-e.slots }()
	if ctx.Err() != nil { // a slot and the cancel came together
		return daemon.Outcome{ExitCode: -1, Err: "cancelled before it started"}
	}

	// Time limit: the payload's timeout and the command's deadline,
	// whichever comes first.
	runCtx, cancelRun := ctx, context.CancelFunc(func() {})
	limit := spec.timeout
	byDeadline := false
	if !spec.deadline.IsZero() {
		if left := time.Until(spec.deadline); limit <= 0 || left < limit {
			limit, byDeadline = max(left, 0), true
		}
	}
	if limit > 0 || byDeadline {
		runCtx, cancelRun = context.WithTimeout(ctx, limit)
	}
	defer cancelRun()

	id, err := resolveIdentity(spec.user, spec.group)
	if err != nil {
		return outcomeOf(err)
	}
	dir := spec.dir
	if dir == "" {
		dir = "/"
		if fi, err := os.Stat(id.home); id.home != "" && err == nil && fi.IsDir() {
			dir = id.home
		}
	} else if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		return failf(CodeNotFound, "dir %s is not a directory on this node", dir)
	}
	prog, err := exec.LookPath(spec.argv[0])
	if err != nil {
		return failf(CodeNotFound, "%v", err)
	}
	if spec.prepare != nil {
		if err := spec.prepare(id); err != nil {
			return outcomeOf(err)
		}
	}

	cmd := exec.Command(prog, spec.argv[1:]...)
	cmd.Args[0] = spec.argv[0]
	cmd.Env = environ(id, spec.env)
	cmd.Dir = dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: id.cred}
	cg, err := e.commandCgroup(log, spec.id)
	if err != nil {
		return failf(CodeStartFailed, "%v", err)
	}
	cgDir := ""
	if cg != nil {
		// Removed once the command is over and everything in it is gone.
		defer e.releaseCgroup(log, cg)
		cg.setProcAttr(cmd.SysProcAttr)
		cgDir = cg.dir
	}
	if len(spec.stdin) > 0 {
		cmd.Stdin = bytes.NewReader(spec.stdin)
	}
	// Stdin's copy goroutine must not keep Wait waiting on a process that
	// never reads it.
	cmd.WaitDelay = e.cfg.KillGrace
	// Pipes of our own, not exec's: a background child holding the write
	// end must not keep Wait from returning, and the read ends are closed
	// by us once the group is gone.
	outR, outW, err := os.Pipe()
	if err != nil {
		return failf(CodeStartFailed, "stdout pipe: %v", err)
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		_ = outR.Close()
		_ = outW.Close()
		return failf(CodeStartFailed, "stderr pipe: %v", err)
	}
	cmd.Stdout, cmd.Stderr = outW, errW
	err = cmd.Start()
	_ = outW.Close()
	_ = errW.Close()
	if cg != nil {
		cg.closeFD()
	}
	if err != nil {
		_ = outR.Close()
		_ = errR.Close()
		if errors.Is(err, os.ErrPermission) {
			return failf(CodePermissionDenied, "start %s: %v", spec.argv[0], err)
		}
		return failf(CodeStartFailed, "start %s: %v", spec.argv[0], err)
	}
	pid := cmd.Process.Pid
	// cgroup is the command's cgroup directory, "" when it runs in its
	// process group only.
	log.Debug("started", "pid", pid, "argv0", spec.argv[0], "cgroup", cgDir)

	tail := &tailBuffer{limit: ResultTailBytes}
	var copiers sync.WaitGroup
	for _, c := range []struct {
		r *os.File
		w io.Writer
	}{{outR, daemon.Stdout(ctx)}, {errR, daemon.Stderr(ctx)}} {
		copiers.Go(func() {
			_, _ = io.Copy(io.MultiWriter(c.w, tail), c.r)
		})
	}

	// The main process is waited for without reaping it: while it is a
	// zombie its pid, which is the group's id, cannot be reused, so the
	// group signals below cannot reach a stranger.
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		waitNoReap(pid)
	}()

	reason := stopNone
	var termAt time.Time
	killed := false
	select {
	case <-exited:
	case <-runCtx.Done():
		reason = stopCancel
		if ctx.Err() == nil {
			reason = stopTimeout
		}
		termAt = time.Now()
		signalCommand(log, pid, cg, syscall.SIGTERM)
		grace := time.NewTimer(e.cfg.KillGrace)
		select {
		case <-exited:
		case <-grace.C:
			signalCommand(log, pid, cg, syscall.SIGKILL)
			killed = true
			<-exited
		}
		grace.Stop()
	}
	// Anything left in the group or the cgroup (a background child, a
	// daemon that called setsid) goes too.
	e.stopLeftovers(log, pid, cg, termAt, killed)
	waitErr := cmd.Wait()

	// The pipes reach EOF when the last holder exits; one that escaped the
	// group (setsid, without a cgroup; or a root process that moved itself
	// out of its cgroup) is not waited for beyond a moment.
	copied := make(chan struct{})
	go func() { copiers.Wait(); close(copied) }()
	select {
	case <-copied:
	case <-time.After(2 * time.Second):
		log.Warn("a process outside the command's group keeps its output open; not reading it further", "pid", pid, "cgroup", cgDir)
		_ = outR.Close()
		_ = errR.Close()
		<-copied
	}
	_ = outR.Close()
	_ = errR.Close()

	o := daemon.Outcome{Output: tail.bytes()}
	ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus)
	if !ok {
		o.ExitCode, o.Err = -1, fmt.Sprintf("%s: wait: %v", CodeStartFailed, waitErr)
		return o
	}
	var how string
	switch {
	case ws.Signaled():
		o.ExitCode = 128 + int32(ws.Signal())
		how = "terminated by " + signalName(ws.Signal())
		if ws.Signal() == syscall.SIGKILL {
			how = "killed by SIGKILL"
			if killed {
				how += fmt.Sprintf(" after the %s grace", e.cfg.KillGrace)
			}
		}
	default:
		o.ExitCode = int32(ws.ExitStatus())
		if reason != stopNone {
			how = fmt.Sprintf("exited %d after SIGTERM", o.ExitCode)
		}
	}
	switch reason {
	case stopCancel:
		o.Err = how + " (cancelled)"
	case stopTimeout:
		o.Err = fmt.Sprintf("timed out after %s (%s)", limit.Round(time.Millisecond), how)
		if byDeadline {
			o.Err = fmt.Sprintf("timed out at the command's deadline after %s (%s)", limit.Round(time.Millisecond), how)
		}
	default:
		o.Err = how
	}
	return o
}

// stopLeftovers stops the processes left in group pgid, and in cgroup cg
// when there is one, after its main process exited: SIGTERM (unless one
// was sent at termAt), SIGKILL once the grace since then has passed, and
// a wait until none is alive.
func (e *Executor) stopLeftovers(log *slog.Logger, pgid int, cg *cmdCgroup, termAt time.Time, killed bool) {
	alive := func() bool { return groupAlive(pgid) }
	cgDir := ""
	if cg != nil {
		// Everything the command started is in its cgroup (a root process
		// may move itself out, on purpose): the cgroup's populated flag
		// answers for the group too, without the scan of /proc.
		cgDir = cg.dir
		alive = func() bool {
			if full, err := cg.populated(); err == nil {
				return full
			}
			return groupAlive(pgid)
		}
	}
	if !alive() {
		return
	}
	if killed {
		signalCommand(log, pgid, cg, syscall.SIGKILL)
	} else if termAt.IsZero() {
		termAt = time.Now()
		log.Info("processes left in the command's group after it exited; stopping them", "pgid", pgid, "cgroup", cgDir)
		signalCommand(log, pgid, cg, syscall.SIGTERM)
	}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for alive() {
		if !killed && time.Since(termAt) >= e.cfg.KillGrace {
			signalCommand(log, pgid, cg, syscall.SIGKILL)
			killed = true
			termAt = time.Now()
		}
		if killed && time.Since(termAt) > 5*time.Second {
			log.Error("processes of the command's group survive SIGKILL (uninterruptible sleep?)", "pgid", pgid, "cgroup", cgDir)
			return
		}
		<-tick.C
	}
}

// signalCommand sends sig to the command's process group pgid and, with a
// cgroup, to the rest of the command: SIGTERM to each process of the
// cgroup outside the group, SIGKILL to the whole cgroup (cgroup.kill).
func signalCommand(log *slog.Logger, pgid int, cg *cmdCgroup, sig syscall.Signal) {
	_ = syscall.Kill(-pgid, sig)
	if cg == nil {
		return
	}
	if sig != syscall.SIGKILL {
		cg.signalOutsideGroup(pgid, sig)
		return
	}
	if err := cg.kill(); err != nil {
		log.Warn("cannot write cgroup.kill; only the process group was sent SIGKILL", "cgroup", cg.dir, "err", err)
	}
}

// commandCgroup makes the cgroup of command id: nil when the executor runs
// commands in process groups only, or when it cannot make one and
// exec.cgroup is auto (a warning says why).
func (e *Executor) commandCgroup(log *slog.Logger, id string) (*cmdCgroup, error) {
	if e.cg == nil {
		return nil, nil
	}
	cg, err := e.cg.create(id)
	if err == nil {
		return cg, nil
	}
	if e.cfg.Cgroup == CgroupRequired {
		return nil, fmt.Errorf("exec.cgroup=required: %w", err)
	}
	log.Warn("running the command in its process group only", "err", err)
	return nil, nil
}

// releaseCgroup removes the command's cgroup, killing what is still in it.
func (e *Executor) releaseCgroup(log *slog.Logger, cg *cmdCgroup) {
	if err := cg.remove(cgroupSettle); err != nil {
		log.Error("cannot remove the command's cgroup", "err", err)
		return
	}
	log.Debug("removed the command's cgroup", "cgroup", cg.dir)
}

// groupAlive reports whether a process of group pgid is alive (not a
// zombie: the main process waits unreaped as one).
func groupAlive(pgid int) bool {
	if err := syscall.Kill(-pgid, 0); errors.Is(err, syscall.ESRCH) {
		return false
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return true // cannot tell; the signal said some process exists
	}
	for _, ent := range entries {
		pid, err := strconv.Atoi(ent.Name())
		if err != nil {
			continue
		}
		state, _, pgrp, ok := procStat(pid)
		if ok && pgrp == pgid && state != 'Z' && state != 'X' {
			return true
		}
	}
	return false
}

// procStat reads a process's state, parent and process group from
// /proc/<pid>/stat.
func procStat(pid int) (state byte, ppid, pgrp int, ok bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0, 0, false
	}
	// The command name is in parentheses and may contain anything.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return 0, 0, 0, false
	}
	f := bytes.Fields(b[i+2:])
	if len(f) < 3 {
		return 0, 0, 0, false
	}
	ppid, err1 := strconv.Atoi(string(f[1]))
	pgrp, err2 := strconv.Atoi(string(f[2]))
	return f[0][0], ppid, pgrp, err1 == nil && err2 == nil
}

// waitNoReap blocks until process pid has exited, leaving it a zombie for
// cmd.Wait to reap (waitid with WNOWAIT).
func waitNoReap(pid int) {
	const pPID = 1
	var info [128]byte // siginfo_t
	for {
		_, _, errno := syscall.Syscall6(syscall.SYS_WAITID, pPID, uintptr(pid), uintptr(unsafe.Pointer(&info[0])), //nolint:gosec // siginfo_t for waitid
			syscall.WEXITED|syscall.WNOWAIT, 0, 0)
		if errno != syscall.EINTR {
			return
		}
	}
}

var signalNames = map[syscall.Signal]string{
	syscall.SIGHUP: "SIGHUP", syscall.SIGINT: "SIGINT", syscall.SIGQUIT: "SIGQUIT", syscall.SIGILL: "SIGILL",
	syscall.SIGTRAP: "SIGTRAP", syscall.SIGABRT: "SIGABRT", syscall.SIGBUS: "SIGBUS", syscall.SIGFPE: "SIGFPE",
	syscall.SIGKILL: "SIGKILL", syscall.SIGUSR1: "SIGUSR1", syscall.SIGSEGV: "SIGSEGV", syscall.SIGUSR2: "SIGUSR2",
	syscall.SIGPIPE: "SIGPIPE", syscall.SIGALRM: "SIGALRM", syscall.SIGTERM: "SIGTERM", syscall.SIGXCPU: "SIGXCPU",
	syscall.SIGXFSZ: "SIGXFSZ", syscall.SIGSYS: "SIGSYS",
}

func signalName(s syscall.Signal) string {
	if n, ok := signalNames[s]; ok {
		return n
	}
	return fmt.Sprintf("signal %d", int(s))
}

// tailBuffer keeps the last limit bytes written and counts them all.
type tailBuffer struct {
	limit int
	mu    sync.Mutex
	buf   []byte
	total int64
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.total += int64(len(p))
	if len(p) >= t.limit {
		t.buf = append(t.buf[:0], p[len(p)-t.limit:]...)
		return len(p), nil
	}
	t.buf = append(t.buf, p...)
	if len(t.buf) > 2*t.limit {
		// Compact now and then rather than on every write.
		t.buf = append(t.buf[:0], t.buf[len(t.buf)-t.limit:]...)
	}
	return len(p), nil
}

// bytes is the tail, after a marker line when earlier bytes were dropped.
func (t *tailBuffer) bytes() []byte {
	t.mu.Lock()
	defer t.mu.Unlock()
	kept := t.buf
	if len(kept) > t.limit {
		kept = kept[len(kept)-t.limit:]
	}
	if dropped := t.total - int64(len(kept)); dropped > 0 {
		marker := fmt.Sprintf("[leasehold: %d earlier bytes not kept in the result; the full output is in the command's live output]\n", dropped)
		return append([]byte(marker), kept...)
	}
	return append([]byte(nil), kept...)
}
