//go:build linux

package nodeexec

import (
	"bufio"
	"bytes"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/daemon"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/proctest"
)

// selfCgroup is the "0::" path of process pid ("self" for this one).
func selfCgroup(t *testing.T, pid string) string {
	t.Helper()
	b, err := os.ReadFile("/proc/" + pid + "/cgroup")
	require.NoError(t, err)
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "0::"); ok {
			return rest
		}
	}
	t.Fatalf("/proc/%s/cgroup has no 0:: line: %q", pid, b)
	return ""
}

// testCgroup makes a cgroup for one test below this process's cgroup v2,
// and returns its directory, its path in the hierarchy, and cgroupPaths
// that make it the agent's cgroup (a file standing in for /proc/self/cgroup
// names it). It skips the test where that cannot be done: not root, no
// cgroup v2, no cgroup.kill. Cleanup kills what is left in it and removes
// it.
func testCgroup(t *testing.T) (dir, rel string, paths cgroupPaths) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("making cgroups needs root on this machine; run the tests as root to cover them")
	}
	own, err := ownCgroup(cgroupPaths{}.orDefault())
	if err != nil {
		t.Skipf("no cgroup v2 to test with: %v", err)
	}
	name := fmt.Sprintf("leasehold-test-%d-%d", os.Getpid(), rand.Uint32())
	dir = filepath.Join(own, name)
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Skipf("cannot make a cgroup below %s to test with: %v", own, err)
	}
	t.Cleanup(func() {
		if err := (&cmdCgroup{dir: dir, fd: -1}).remove(cgroupSettle); err != nil {
			t.Errorf("removing the test's cgroup: %v", err)
		}
	})
	if _, err := os.Stat(filepath.Join(dir, "cgroup.kill")); err != nil {
		t.Skipf("no cgroup.kill (Linux 5.14) to test with: %v", err)
	}
	rel = path.Join(selfCgroup(t, "self"), name)
	self := filepath.Join(t.TempDir(), "cgroup")
	require.NoError(t, os.WriteFile(self, []byte("0::"+rel+"\n"), 0o600))
	return dir, rel, cgroupPaths{mountinfo: "/proc/self/mountinfo", self: self}
}

// startIn starts sleep s in cgroup dir, in a session of its own, as a
// process the agent did not start; the channel is closed when it has
// exited. Cleanup kills and reaps it.
func startIn(t *testing.T, dir, s string) <-chan struct{} {
	t.Helper()
	fd, err := syscall.Open(dir, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
	require.NoError(t, err)
	defer func() { _ = syscall.Close(fd) }()
	cmd := exec.Command("sleep", s)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, UseCgroupFD: true, CgroupFD: fd}
	require.NoError(t, cmd.Start())
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
	})
	return exited
}

// setsidChild is a shell line that starts, in a session of its own, a
// sleep that ignores SIGTERM and writes its pid to "$1"; only SIGKILL ends
// it, and the command's process group does not hold it.
func setsidChild(m string) string {
	return `setsid sh -c 'trap "" TERM; echo $$ > "$1"; exec sleep ` + m + `' sh "$1" &`
}

// waitPid waits for file to hold a pid, and kills that process at cleanup
// if it is still the sleep of marker m.
func waitPid(t *testing.T, file, m string) int {
	t.Helper()
	var pid int
	require.Eventually(t, func() bool {
		b, err := os.ReadFile(file)
		if err != nil || !bytes.HasSuffix(b, []byte("\n")) {
			return false
		}
		pid, err = strconv.Atoi(string(bytes.TrimSpace(b)))
		return err == nil
	}, 20*time.Second, 5*time.Millisecond, "no pid in %s", file)
	t.Cleanup(func() {
		if b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline"); err == nil && bytes.Contains(b, []byte(m)) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	return pid
}

// requireNoCommandCgroups requires that no command cgroup is left in dir.
func requireNoCommandCgroups(t *testing.T, dir string) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, ent := range entries {
		require.False(t, strings.HasPrefix(ent.Name(), cgroupCmdPrefix), "cgroup %s/%s left behind", dir, ent.Name())
	}
}

// requireEscaped requires that process pid runs in a command's cgroup
// below rel, in a process group and session of its own (it called setsid).
func requireEscaped(t *testing.T, pid int, rel string) {
	t.Helper()
	cg := selfCgroup(t, strconv.Itoa(pid))
	require.Equal(t, rel, path.Dir(cg), "the grandchild's cgroup")
	require.True(t, strings.HasPrefix(path.Base(cg), cgroupCmdPrefix+"c-"), "the grandchild's cgroup %s is its command's", cg)
	_, _, pgrp, ok := procStat(pid)
	require.True(t, ok)
	require.Equal(t, pid, pgrp, "the grandchild leads a process group of its own")
}

// TestCgroupCancelKillsSetsidGrandchild: a cancelled command's grandchild
// that left its process group and session (setsid) and ignores SIGTERM is
// killed after the grace with the rest of the cgroup, which is removed.
// Without the cgroup it would survive the command.
func TestCgroupCancelKillsSetsidGrandchild(t *testing.T) {
	t.Parallel()
	dir, rel, paths := testCgroup(t)
	e := newExecutor(t, func(c *Config) { c.Cgroup, c.cgroupPaths, c.KillGrace = CgroupRequired, paths, 300*time.Millisecond })
	require.NotNil(t, e.cg)
	m := marker()
	pidFile := filepath.Join(t.TempDir(), "pid")
	r := start(t, e, "exec", execPayload(t, "sh", "-c", setsidChild(m)+" echo started; sleep "+m, "sh", pidFile))
	r.waitOutput(t, "started\n")
	pid := waitPid(t, pidFile, m)
	requireEscaped(t, pid, rel)

	r.cancel()
	o := r.wait(t)
	require.Equal(t, int32(128+15), o.ExitCode)
	require.Equal(t, "terminated by SIGTERM (cancelled)", o.Err)
	requireGone(t, strconv.Itoa(pid))
	requireNoneLeft(t, m)
	requireNoCommandCgroups(t, dir)
}

// TestCgroupExitKillsSetsidChild: a command that exits normally, leaving
// a child that called setsid and ignores SIGTERM (a daemon it started),
// returns its own exit status; the child is killed after the grace and
// the cgroup removed.
func TestCgroupExitKillsSetsidChild(t *testing.T) {
	t.Parallel()
	dir, rel, paths := testCgroup(t)
	e := newExecutor(t, func(c *Config) { c.Cgroup, c.cgroupPaths, c.KillGrace = CgroupRequired, paths, 300*time.Millisecond })
	m := marker()
	tmp := t.TempDir()
	pidFile, goOn := filepath.Join(tmp, "pid"), filepath.Join(tmp, "go-on")
	r := start(t, e, "exec", execPayload(t, "sh", "-c", setsidChild(m)+` while [ ! -e "$2" ]; do sleep 0.01; done; echo done`, "sh", pidFile, goOn))
	pid := waitPid(t, pidFile, m)
	requireEscaped(t, pid, rel)
	require.NoError(t, os.WriteFile(goOn, nil, 0o600))
	o := r.wait(t)
	require.Equal(t, int32(0), o.ExitCode, o.Err)
	require.Empty(t, o.Err)
	require.Equal(t, "done\n", r.stdout.String())
	requireGone(t, strconv.Itoa(pid))
	requireNoneLeft(t, m)
	requireNoCommandCgroups(t, dir)
}

// TestCgroupStaleRemovedAtStart: the command cgroups a killed agent left,
// with processes in them and in a cgroup below, are killed and removed
// when the executor starts; other cgroups are not touched.
func TestCgroupStaleRemovedAtStart(t *testing.T) {
	t.Parallel()
	dir, _, paths := testCgroup(t)
	stale := filepath.Join(dir, cgroupName("old-command"))
	inner := filepath.Join(stale, "inner")
	other := filepath.Join(dir, "other")
	for _, d := range []string{stale, inner, other} {
		require.NoError(t, os.Mkdir(d, 0o755))
	}
	m := marker()
	var exited []<-chan struct{}
	for _, d := range []string{stale, inner, other} {
		exited = append(exited, startIn(t, d, m))
	}
	newExecutor(t, func(c *Config) { c.Cgroup, c.cgroupPaths = CgroupRequired, paths })
	require.NoDirExists(t, stale)
	require.DirExists(t, other)
	for i, done := range exited[:2] {
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatalf("process %d of the stale cgroup is alive", i)
		}
	}
	select {
	case <-exited[2]:
		t.Fatal("the process of a cgroup that is not a command's was killed")
	default:
	}
}

// TestCgroupFallback: where cgroup v2 is not usable, auto runs commands in
// process groups and logs why at info, required refuses to start with the
// reason, and CheckCgroups gives the same reason.
func TestCgroupFallback(t *testing.T) {
	t.Parallel()
	v1Only := "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
	cases := []struct {
		name   string
		root   bool // needs a real cgroup
		setup  func(t *testing.T) cgroupPaths
		reason string
	}{
		{name: "no cgroup2 mounted", reason: "cgroup v2 is not mounted", setup: func(t *testing.T) cgroupPaths {
			return fakeProc(t, v1Only, "1:cpu:/\n0::/\n")
		}},
		{name: "cgroup v1 only", reason: "has no cgroup v2 line", setup: func(t *testing.T) cgroupPaths {
			return fakeProc(t, v1Only, "1:cpu:/\n")
		}},
		{name: "not a cgroup2 filesystem: no cgroup.kill", reason: "no cgroup.kill in a new cgroup (it needs Linux 5.14 or later)", setup: func(t *testing.T) cgroupPaths {
			base := t.TempDir()
			require.NoError(t, os.WriteFile(filepath.Join(base, "cgroup.procs"), nil, 0o600))
			t.Cleanup(func() { require.NoDirExists(t, filepath.Join(base, cgroupProbe), "the probe cgroup is removed") })
			return fakeProc(t, "41 31 0:38 / "+base+" rw,relatime - cgroup2 cgroup2 rw\n", "0::/\n")
		}},
		{name: "cannot make a cgroup", root: true, reason: "cannot create a cgroup in the agent's cgroup", setup: func(t *testing.T) cgroupPaths {
			dir, _, paths := testCgroup(t)
			require.NoError(t, writeCgroupFile(filepath.Join(dir, "cgroup.max.descendants"), "0"))
			return paths
		}},
		{name: "shared cgroup", root: true, reason: "besides the agent", setup: func(t *testing.T) cgroupPaths {
			dir, _, paths := testCgroup(t)
			startIn(t, dir, marker())
			return paths
		}},
		{name: "a systemd unit's cgroup without Delegate=yes", root: true, reason: "is a systemd unit's without Delegate=yes", setup: func(t *testing.T) cgroupPaths {
			dir, rel, _ := testCgroup(t)
			require.NoError(t, os.Mkdir(filepath.Join(dir, "leasehold-node.service"), 0o755))
			return fakeProc(t, mountinfoOf(t), "0::"+rel+"/leasehold-node.service\n")
		}},
		{name: "another agent's leaf", root: true, reason: "another leasehold-node owns the cgroup", setup: func(t *testing.T) cgroupPaths {
			dir, _, paths := testCgroup(t)
			require.NoError(t, os.Mkdir(filepath.Join(dir, cgroupLeaf), 0o755))
			startIn(t, filepath.Join(dir, cgroupLeaf), marker())
			return paths
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			paths := tc.setup(t)
			cfg := DefaultConfig()
			cfg.cgroupPaths = paths
			err := CheckCgroups(cfg)
			require.ErrorContains(t, err, tc.reason)

			var logs proctest.Buffer
			e, err := New(cfg, slog.New(slog.NewTextHandler(&logs, nil)))
			require.NoError(t, err)
			t.Cleanup(e.Close)
			require.Nil(t, e.cg)
			require.Contains(t, logs.String(), "level=INFO msg=\"commands run in their process groups only, without cgroups")
			require.Contains(t, logs.String(), tc.reason)
			o, _ := handle(t, e, "exec", execPayload(t, "sh", "-c", "grep ^0:: /proc/self/cgroup"))
			require.Equal(t, int32(0), o.ExitCode, o.Err)
			if tc.root {
				require.Equal(t, "0::"+selfCgroup(t, "self")+"\n", string(o.Output), "the command runs in the agent's cgroup")
			}

			cfg.Cgroup = CgroupRequired
			_, err = New(cfg, nil)
			require.ErrorContains(t, err, "exec.cgroup=required: ")
			require.ErrorContains(t, err, tc.reason)
		})
	}
}

// mountinfoOf is this process's mountinfo.
func mountinfoOf(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	require.NoError(t, err)
	return string(b)
}

// TestCgroupDelegatedUnit: a systemd unit's cgroup that systemd marked as
// delegated (Delegate=yes) is the agent's to use.
func TestCgroupDelegatedUnit(t *testing.T) {
	t.Parallel()
	dir, rel, _ := testCgroup(t)
	unit := filepath.Join(dir, "leasehold-node.service")
	require.NoError(t, os.Mkdir(unit, 0o755))
	paths := fakeProc(t, mountinfoOf(t), "0::"+rel+"/leasehold-node.service\n")
	require.ErrorContains(t, CheckCgroups(Config{cgroupPaths: paths}), "without Delegate=yes")
	if err := syscall.Setxattr(unit, "trusted.delegate", []byte("1"), 0); err != nil {
		t.Skipf("cannot set trusted.delegate on a cgroup here: %v", err)
	}
	require.NoError(t, CheckCgroups(Config{cgroupPaths: paths}))
	e := newExecutor(t, func(c *Config) { c.Cgroup, c.cgroupPaths = CgroupRequired, paths })
	o, _ := handle(t, e, "exec", execPayload(t, "grep", "^0::", "/proc/self/cgroup"))
	require.Equal(t, int32(0), o.ExitCode, o.Err)
	require.Regexp(t, "^0::"+rel+`/leasehold-node.service/cmd-c-[0-9-]+\n$`, string(o.Output))
}

// fakeProc writes stand-ins for /proc/self/mountinfo and /proc/self/cgroup.
func fakeProc(t *testing.T, mountinfo, self string) cgroupPaths {
	t.Helper()
	d := t.TempDir()
	p := cgroupPaths{mountinfo: filepath.Join(d, "mountinfo"), self: filepath.Join(d, "cgroup")}
	require.NoError(t, os.WriteFile(p.mountinfo, []byte(mountinfo), 0o600))
	require.NoError(t, os.WriteFile(p.self, []byte(self), 0o600))
	return p
}

// TestCgroupOutcomes: in cgroups, commands end and report as they do in
// process groups only (process_test.go), and leave no cgroup behind.
func TestCgroupOutcomes(t *testing.T) {
	t.Parallel()
	dir, rel, paths := testCgroup(t)
	e := newExecutor(t, func(c *Config) { c.Cgroup, c.cgroupPaths, c.KillGrace = CgroupRequired, paths, 300*time.Millisecond })

	o, r := handle(t, e, "exec", execPayload(t, "sh", "-c", "grep ^0:: /proc/self/cgroup; echo err >&2; exit 3"))
	require.Equal(t, int32(3), o.ExitCode)
	require.Empty(t, o.Err)
	require.Regexp(t, `^0::`+rel+`/cmd-c-[0-9-]+\n$`, r.stdout.String())
	require.Equal(t, "err\n", r.stderr.String())

	m := marker()
	r = start(t, e, "exec", execPayload(t, "sh", "-c", "trap '' TERM; sleep "+m+" & echo started $$ $!; sleep "+m))
	r.waitOutput(t, "\n")
	r.cancel()
	o = r.wait(t)
	require.Equal(t, int32(128+9), o.ExitCode)
	require.Equal(t, "killed by SIGKILL after the 300ms grace (cancelled)", o.Err)
	requireNoneLeft(t, m)
	requireGone(t, strings.Fields(r.stdout.String())[1:]...)

	o, _ = handle(t, e, "exec", mustJSON(t, map[string]any{"argv": []string{"sleep", m}, "timeout": "0.2s"}))
	require.Equal(t, int32(128+15), o.ExitCode)
	require.Equal(t, "timed out after 200ms (terminated by SIGTERM)", o.Err)

	o, _ = handle(t, e, "script", mustJSON(t, map[string]any{"interpreter": "sh", "user": "nobody", "script": "id -un; grep -c ^0::" + rel + "/cmd- /proc/self/cgroup"}))
	require.Equal(t, int32(0), o.ExitCode, o.Err)
	require.Equal(t, "nobody\n1\n", string(o.Output))

	// Command ids that are no directory names, and one id twice at once:
	// each command waits until all four run.
	long := strings.Repeat("x", 300)
	barrier := t.TempDir()
	wait4 := `touch "$1/$$"; while [ "$(ls "$1" | wc -l)" -lt 4 ]; do sleep 0.01; done; grep ^0:: /proc/self/cgroup`
	var runs []*run
	for _, id := range []string{"../../etc", "a b/c", long, long} {
		rr := &run{done: make(chan daemon.Outcome, 1)}
		cmd := &nodev1.Command{CommandId: id, Kind: "exec", Payload: []byte(execPayload(t, "sh", "-c", wait4, "sh", barrier))}
		go func() { rr.done <- e.Handle(t.Context(), cmd) }()
		runs = append(runs, rr)
	}
	var seen []string
	for _, rr := range runs {
		o := rr.wait(t)
		require.Equal(t, int32(0), o.ExitCode, o.Err)
		cg := strings.TrimSpace(strings.TrimPrefix(string(o.Output), "0::"))
		require.Equal(t, rel, path.Dir(cg), "in a cgroup of the agent's")
		seen = append(seen, path.Base(cg))
	}
	require.Equal(t, "cmd-.._.._etc", seen[0])
	require.Equal(t, "cmd-a_b_c", seen[1])
	require.ElementsMatch(t, []string{"cmd-" + long[:cgroupNameMax], "cmd-" + long[:cgroupNameMax] + ".1"}, seen[2:])
	requireNoCommandCgroups(t, dir)

	// A cgroup that cannot be made: required fails the command, auto runs
	// it in its process group only.
	auto := newExecutor(t, func(c *Config) { c.Cgroup, c.cgroupPaths = CgroupAuto, paths })
	require.NotNil(t, auto.cg)
	require.NoError(t, writeCgroupFile(filepath.Join(dir, "cgroup.max.descendants"), "0"))
	o, _ = handle(t, e, "exec", execPayload(t, "true"))
	require.Equal(t, int32(-1), o.ExitCode)
	require.True(t, strings.HasPrefix(o.Err, "start_failed: exec.cgroup=required: create the command's cgroup "+dir+"/cmd-c-"), o.Err)
	o, _ = handle(t, auto, "exec", execPayload(t, "grep", "^0::", "/proc/self/cgroup"))
	require.Equal(t, int32(0), o.ExitCode, o.Err)
	require.Equal(t, "0::"+selfCgroup(t, "self")+"\n", string(o.Output))
}

// TestCgroupAgentHelper is the agent of TestCgroupAgentLayout, run as a
// process of its own in a cgroup that stands for a systemd unit's.
func TestCgroupAgentHelper(t *testing.T) {
	out := os.Getenv("LEASEHOLD_NODEEXEC_CGROUP_HELPER")
	if out == "" {
		t.Skip("TestCgroupAgentLayout runs this as a process of its own")
	}
	cfg := DefaultConfig()
	cfg.Cgroup = CgroupRequired
	e, err := New(cfg, nil)
	require.NoError(t, err)
	defer e.Close()
	var report strings.Builder
	fmt.Fprintf(&report, "agent %s\n", selfCgroup(t, "self"))
	o, _ := handle(t, e, "exec", execPayload(t, "sh", "-c", "sed -n 's/^0:://p' /proc/self/cgroup"))
	require.Equal(t, int32(0), o.ExitCode, o.Err)
	fmt.Fprintf(&report, "command %s", o.Output)
	entries, err := os.ReadDir(e.cg.dir)
	require.NoError(t, err)
	for _, ent := range entries {
		if ent.IsDir() {
			fmt.Fprintf(&report, "left %s\n", ent.Name())
		}
	}
	require.NoError(t, os.WriteFile(out, []byte(report.String()), 0o600))
}

// TestCgroupAgentLayout: an agent started alone in a cgroup (a systemd
// unit's with Delegate=yes) finds it through /proc/self, moves itself into
// its leaf "agent", runs each command in a cgroup beside it, and leaves
// only its leaf.
func TestCgroupAgentLayout(t *testing.T) {
	t.Parallel()
	dir, rel, _ := testCgroup(t)
	unit := filepath.Join(dir, "unit")
	require.NoError(t, os.Mkdir(unit, 0o755))
	fd, err := syscall.Open(unit, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
	require.NoError(t, err)
	defer func() { _ = syscall.Close(fd) }()
	out := filepath.Join(t.TempDir(), "report")
	cmd := exec.Command(os.Args[0], "-test.run=^TestCgroupAgentHelper$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), "LEASEHOLD_NODEEXEC_CGROUP_HELPER="+out)
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: fd}
	b, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", b)
	report, err := os.ReadFile(out)
	require.NoError(t, err, "%s", b)
	lines := map[string][]string{}
	sc := bufio.NewScanner(bytes.NewReader(report))
	for sc.Scan() {
		k, v, _ := strings.Cut(sc.Text(), " ")
		lines[k] = append(lines[k], v)
	}
	unitRel := rel + "/unit"
	require.Equal(t, []string{unitRel + "/" + cgroupLeaf}, lines["agent"], "%s", report)
	require.Len(t, lines["command"], 1, "%s", report)
	require.Regexp(t, "^"+unitRel+`/cmd-c-[0-9-]+$`, lines["command"][0])
	require.Equal(t, []string{cgroupLeaf}, lines["left"], "%s", report)
}

func TestOwnCgroupAndNames(t *testing.T) {
	t.Parallel()
	whole := "25 1 0:22 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
	slice := "26 1 0:22 /system.slice /mnt/my\\040cg rw shared:9 - cgroup2 cgroup2 rw\n"
	cases := []struct{ mountinfo, self, want string }{
		{whole + slice, "0::/system.slice/leasehold-node.service\n", "/sys/fs/cgroup/unified/system.slice/leasehold-node.service"},
		{slice, "0::/system.slice/leasehold-node.service\n", "/mnt/my cg/leasehold-node.service"},
		{slice, "0::/system.slice\n", "/mnt/my cg"},
		{"40 1 0:22 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n", "12:pids:/x\n0::/\n", "/sys/fs/cgroup"},
	}
	for _, tc := range cases {
		got, err := ownCgroup(fakeProc(t, tc.mountinfo, tc.self))
		require.NoError(t, err, tc.self)
		require.Equal(t, tc.want, got)
	}
	_, err := ownCgroup(fakeProc(t, slice, "0::/user.slice\n"))
	require.ErrorContains(t, err, "cgroup v2 is not mounted")

	require.Equal(t, "cmd-0f1e-AB_c.d_e__", cgroupName("0f1e-AB_c.d/e\n\xff"))
	require.Equal(t, "cmd-unnamed", cgroupName(""))
}
