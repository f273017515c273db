//go:build linux

package daemon

// A tunnel's shell (docs/gateway.md, "Tunnels"): Config.TunnelShell run in
// a session of its own (setsid), on a pseudo-terminal that is its
// controlling terminal when the OpenTunnel carries a terminal size, with
// pipes otherwise, as Config.TunnelShellUser when one is set. When the
// shell exits, or the tunnel ends first, every process left in its session
// is killed: a tunnel leaves no process behind (only one that made a
// session of its own, as a daemon does, escapes).

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/creack/pty"
	"golang.org/x/sys/unix"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// shellExitDrain bounds how long a shell's output is still read once it
// exited and its session was killed (a process that escaped the session
// could hold the terminal or the pipe open).
const shellExitDrain = 2 * time.Second

// shellSpec is what a shell tunnel runs.
type shellSpec struct {
	argv []string
	// size runs the shell on a pseudo-terminal of this size; nil: pipes.
	size *nodev1.TerminalSize
	// term is the pseudo-terminal's TERM (already validated).
	term string
	// user runs the shell as this user; nil: the daemon's.
	user *user.User
}

// shellProc is a running tunnel shell. Writes go to its input (the pty, or
// its stdin); reads come from its output (the pty, or stdout and stderr
// together) until it exited and every process of its session is gone.
type shellProc struct {
	cmd *exec.Cmd
	out *os.File       // pty master, or the read end of the output pipe
	in  io.WriteCloser // pty master, or the stdin pipe
	pty bool
	sid int // the shell's pid: its session and process group

	mu     sync.Mutex
	reaped bool
	// exited is closed once the shell was reaped; status is set before.
	exited chan struct{}
	status *nodev1.ShellExit

	closeOnce sync.Once
}

// lookupShellUser finds the user named (or numbered) name.
func lookupShellUser(name string) (*user.User, error) {
	u, err := user.Lookup(name)
	if err == nil {
		return u, nil
	}
	if _, nerr := strconv.ParseUint(name, 10, 32); nerr == nil {
		if u, ierr := user.LookupId(name); ierr == nil {
			return u, nil
		}
	}
	return nil, fmt.Errorf("no such user: %w", err)
}

// shellCredential is u's uid, gid and groups for SysProcAttr.Credential.
func shellCredential(u *user.User) (*syscall.Credential, error) {
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("user %s: uid %q: %w", u.Username, u.Uid, err)
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("user %s: gid %q: %w", u.Username, u.Gid, err)
	}
	cred := &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	gids, err := u.GroupIds()
	if err != nil {
		return nil, fmt.Errorf("user %s: groups: %w", u.Username, err)
	}
	for _, g := range gids {
		if n, err := strconv.ParseUint(g, 10, 32); err == nil {
			cred.Groups = append(cred.Groups, uint32(n))
		}
	}
	return cred, nil
}

// shellEnv is the shell's environment: the daemon's own for the daemon's
// user (nil), or a clean one for another user, so nothing of the daemon's
// environment reaches it; TERM is set on a pseudo-terminal.
func shellEnv(spec shellSpec) []string {
	var env []string
	if spec.user != nil {
		env = []string{
			"HOME=" + spec.user.HomeDir, "USER=" + spec.user.Username, "LOGNAME=" + spec.user.Username,
			"SHELL=" + spec.argv[0], "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		}
		if lang, ok := os.LookupEnv("LANG"); ok {
			env = append(env, "LANG="+lang)
		}
	} else if spec.size != nil {
		for _, kv := range os.Environ() {
			if !strings.HasPrefix(kv, "TERM=") {
				env = append(env, kv)
			}
		}
	}
	if spec.size != nil {
		env = append(env, "TERM="+spec.term)
	}
	return env
}

// startShell starts spec's shell and the goroutine that reaps it.
func startShell(spec shellSpec) (*shellProc, error) {
	cmd := exec.Command(spec.argv[0], spec.argv[1:]...)
	cmd.Env = shellEnv(spec)
	attr := &syscall.SysProcAttr{Setsid: true}
	if spec.user != nil {
		cred, err := shellCredential(spec.user)
		if err != nil {
			return nil, err
		}
		attr.Credential = cred
		if st, err := os.Stat(spec.user.HomeDir); err == nil && st.IsDir() {
			cmd.Dir = spec.user.HomeDir
		} else {
			cmd.Dir = "/"
		}
	}
	cmd.SysProcAttr = attr
	s := &shellProc{cmd: cmd, pty: spec.size != nil, exited: make(chan struct{})}
	var err error
	if s.pty {
		err = s.startPty(spec, attr)
	} else {
		err = s.startPipes()
	}
	if err != nil {
		return nil, err
	}
	s.sid = cmd.Process.Pid
	go s.wait()
	return s, nil
}

// startPipes starts the shell with its stdin on one pipe and its stdout and
// stderr together on another.
func (s *shellProc) startPipes() error {
	stdin, err := s.cmd.StdinPipe()
	if err != nil {
		return fmt.Errorf("stdin pipe: %w", err)
	}
	r, w, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("output pipe: %w", err)
	}
	s.cmd.Stdout, s.cmd.Stderr = w, w
	if err := s.cmd.Start(); err != nil {
		_ = r.Close()
		_ = w.Close()
		return err
	}
	_ = w.Close() // the shell's session holds its copies: EOF once they are gone
	s.in, s.out = stdin, r
	return nil
}

// startPty starts the shell on a new pseudo-terminal of spec.size that
// becomes its controlling terminal.
func (s *shellProc) startPty(spec shellSpec, attr *syscall.SysProcAttr) error {
	ptmx, tty, err := pty.Open()
	if err != nil {
		return fmt.Errorf("open a pseudo-terminal: %w", err)
	}
	defer func() { _ = tty.Close() }() // the shell holds its own copies
	master, err := pollable(ptmx)
	if err != nil {
		return err
	}
	if err := setWinsize(master, spec.size); err != nil {
		_ = master.Close()
		return err
	}
	if c := attr.Credential; c != nil {
		// The terminal belongs to the shell's user, as a login's does.
		if err := os.Chown(tty.Name(), int(c.Uid), int(c.Gid)); err != nil {
			_ = master.Close()
			return fmt.Errorf("give %s to user %s: %w", tty.Name(), spec.user.Username, err)
		}
	}
	attr.Setctty, attr.Ctty = true, 0 // Ctty is the child's stdin
	s.cmd.Stdin, s.cmd.Stdout, s.cmd.Stderr = tty, tty, tty
	if err := s.cmd.Start(); err != nil {
		_ = master.Close()
		return err
	}
	s.in, s.out = master, master
	return nil
}

// pollable returns f's descriptor as a non-blocking file in Go's poller, so
// a read deadline and Close end a pending Read (creack/pty leaves the
// master in blocking mode); f is closed.
func pollable(f *os.File) (*os.File, error) {
	defer func() { _ = f.Close() }()
	sc, err := f.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("pseudo-terminal master: %w", err)
	}
	fd := -1
	var derr error
	if err := sc.Control(func(raw uintptr) { fd, derr = unix.Dup(int(raw)) }); err != nil {
		return nil, fmt.Errorf("pseudo-terminal master: %w", err)
	}
	if derr != nil {
		return nil, fmt.Errorf("dup the pseudo-terminal master: %w", derr)
	}
	unix.CloseOnExec(fd)
	if err := unix.SetNonblock(fd, true); err != nil {
		_ = unix.Close(fd)
		return nil, fmt.Errorf("pseudo-terminal master non-blocking: %w", err)
	}
	return os.NewFile(uintptr(fd), f.Name()), nil
}

// setWinsize sets the size of the pseudo-terminal f is the master of (the
// kernel signals SIGWINCH to its foreground process group).
func setWinsize(f *os.File, sz *nodev1.TerminalSize) error {
	sc, err := f.SyscallConn()
	if err != nil {
		return fmt.Errorf("set the terminal size: %w", err)
	}
	ws := &unix.Winsize{Row: uint16(sz.GetRows()), Col: uint16(sz.GetCols())}
	var ierr error
	if err := sc.Control(func(fd uintptr) { ierr = unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, ws) }); err != nil {
		return fmt.Errorf("set the terminal size: %w", err)
	}
	if ierr != nil {
		return fmt.Errorf("set the terminal size to %dx%d: %w", sz.GetRows(), sz.GetCols(), ierr)
	}
	return nil
}

// wait waits for the shell to exit without reaping it (its pid, the
// session id, cannot be reused meanwhile), kills what is left of its
// session, reaps it, and bounds how long its remaining output is read.
func (s *shellProc) wait() {
	var info unix.Siginfo
	for {
		err := unix.Waitid(unix.P_PID, s.sid, &info, unix.WEXITED|unix.WNOWAIT, nil)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	s.mu.Lock()
	killSession(s.sid)
	_ = s.cmd.Wait()
	s.reaped = true
	s.mu.Unlock()
	s.status = exitStatus(s.cmd.ProcessState)
	_ = s.out.SetReadDeadline(time.Now().Add(shellExitDrain)) //nolint:forbidigo // a file's read deadline is on the wall clock by nature
	close(s.exited)
}

// exitStatus is how ps ended: its exit code, or -1 and its signal's name.
func exitStatus(ps *os.ProcessState) *nodev1.ShellExit {
	if ps == nil {
		return &nodev1.ShellExit{ExitCode: -1}
	}
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		name := unix.SignalName(ws.Signal())
		if name == "" {
			name = fmt.Sprintf("signal %d", int(ws.Signal()))
		}
		return &nodev1.ShellExit{ExitCode: -1, Signal: name}
	}
	return &nodev1.ShellExit{ExitCode: int32(ps.ExitCode())}
}

// exitStatus is how the shell ended; call it once exited is closed.
func (s *shellProc) exitStatus() *nodev1.ShellExit { return s.status }

// killSession SIGKILLs every process of session sid, the shell's process
// group first, and again until none is left (one may fork meanwhile). The
// caller guarantees sid's leader is not reaped yet, so sid is still ours.
func killSession(sid int) {
	_ = unix.Kill(-sid, unix.SIGKILL)
	for range 20 {
		left := sessionMembers(sid)
		if len(left) == 0 {
			return
		}
		for _, pid := range left {
			_ = unix.Kill(pid, unix.SIGKILL)
		}
	}
}

// sessionMembers are the live processes of session sid other than its
// leader, from /proc.
func sessionMembers(sid int) []int {
	dirs, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var pids []int
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil || pid == sid {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", d.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid pgrp session ...; comm may hold spaces.
		i := strings.LastIndexByte(string(b), ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) < 4 || f[0] == "Z" || f[0] == "X" {
			continue
		}
		if s, err := strconv.Atoi(f[3]); err == nil && s == sid {
			pids = append(pids, pid)
		}
	}
	return pids
}

func (s *shellProc) Read(p []byte) (int, error) {
	n, err := s.out.Read(p)
	if err != nil && s.pty && errors.Is(err, syscall.EIO) {
		err = io.EOF // every process holding the terminal is gone
	}
	return n, err
}

func (s *shellProc) Write(p []byte) (int, error) { return s.in.Write(p) }

// CloseWrite closes a piped shell's stdin; on a pseudo-terminal, which has
// no half-close, it types the terminal's end-of-file character (^D unless
// the shell changed it), which a shell at its prompt reads as the end of
// its input.
func (s *shellProc) CloseWrite() error {
	if !s.pty {
		return s.in.Close()
	}
	eof := byte(4)
	if sc, err := s.out.SyscallConn(); err == nil {
		_ = sc.Control(func(fd uintptr) {
			if t, err := unix.IoctlGetTermios(int(fd), unix.TCGETS); err == nil && t.Cc[unix.VEOF] != 0 {
				eof = t.Cc[unix.VEOF]
			}
		})
	}
	_, err := s.in.Write([]byte{eof})
	return err
}

// resize sets a pseudo-terminal shell's size; a piped shell has none.
func (s *shellProc) resize(sz *nodev1.TerminalSize) error {
	if !s.pty {
		return nil
	}
	if !validTerminalSize(sz) {
		return fmt.Errorf("resize %dx%d: rows and cols must be in 1..%d", sz.GetRows(), sz.GetCols(), maxTerminalCells)
	}
	return setWinsize(s.out, sz)
}

// Close kills the shell's session if the shell still runs, waits until it
// is reaped, and closes its pipes or terminal.
func (s *shellProc) Close() error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		if !s.reaped {
			killSession(s.sid)
		}
		s.mu.Unlock()
		<-s.exited
		if !s.pty {
			_ = s.in.Close()
		}
		_ = s.out.Close()
	})
	return nil
}
