package nodeexec

import (
	"encoding/json"
	"flag"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestFacts compares the facts with what this machine says through other
// means: os.Hostname, runtime.NumCPU, /proc/meminfo, uname, df's mounts.
func TestFacts(t *testing.T) {
	t.Parallel()
	e := newExecutor(t)
	o, _ := handle(t, e, "facts", "")
	require.Equal(t, int32(0), o.ExitCode, o.Err)
	var f Facts
	require.NoError(t, json.Unmarshal(o.Output, &f), string(o.Output))

	host, err := os.Hostname()
	require.NoError(t, err)
	require.Equal(t, host, f.Hostname)
	require.Equal(t, runtime.NumCPU(), f.CPU.Count)
	require.Equal(t, "test-version", f.AgentVersion)

	mem, err := os.ReadFile("/proc/meminfo")
	require.NoError(t, err)
	for line := range strings.Lines(string(mem)) {
		if v, ok := strings.CutPrefix(line, "MemTotal:"); ok {
			kb, err := strconv.ParseUint(strings.Fields(v)[0], 10, 64)
			require.NoError(t, err)
			require.Equal(t, kb*1024, f.Memory.TotalBytes)
		}
	}
	require.Positive(t, f.Memory.AvailableBytes)
	require.LessOrEqual(t, f.Memory.AvailableBytes, f.Memory.TotalBytes)

	uname := func(arg string) string {
		out, err := exec.Command("uname", arg).Output()
		require.NoError(t, err)
		return strings.TrimSpace(string(out))
	}
	require.Equal(t, uname("-s"), f.Kernel.Name)
	require.Equal(t, uname("-r"), f.Kernel.Release)
	require.Equal(t, uname("-v"), f.Kernel.Version)
	require.Equal(t, uname("-m"), f.Arch)

	if osr, err := os.ReadFile("/etc/os-release"); err == nil {
		require.Contains(t, string(osr), "ID="+f.OS.ID)
		require.NotEmpty(t, f.OS.ID)
		require.Contains(t, string(osr), f.OS.PrettyName)
	}

	var root *Disk
	for i, d := range f.Disks {
		require.False(t, pseudoFS[d.FSType], "pseudo filesystem %+v", d)
		require.LessOrEqual(t, d.AvailableBytes, d.FreeBytes, "%+v", d)
		require.LessOrEqual(t, d.FreeBytes, d.SizeBytes, "%+v", d)
		if d.Mountpoint == "/" {
			root = &f.Disks[i]
		}
	}
	require.NotNil(t, root, "the root filesystem is listed: %+v", f.Disks)
	require.Positive(t, root.SizeBytes)

	var lo *NetIface
	for i, n := range f.Network {
		if n.Name == "lo" {
			lo = &f.Network[i]
		}
	}
	if lo != nil {
		require.Contains(t, lo.Addresses, "127.0.0.1/8")
	}

	require.Positive(t, f.UptimeSeconds)
	booted := f.BootTime.Add(time.Duration(f.UptimeSeconds * float64(time.Second)))
	require.WithinDuration(t, time.Now(), booted, 5*time.Second, "boot time + uptime is now")
}

func TestConfigFlagsAndValidate(t *testing.T) {
	t.Parallel()
	c := DefaultConfig()
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	c.RegisterFlags("node.", fs)
	require.NoError(t, c.Validate())
	require.NoError(t, fs.Parse([]string{"-node.exec.max-concurrent=3", "-node.exec.kill-grace=2s", "-node.file.roots=/srv, /etc/app",
		"-node.file.max-bytes=100", "-node.allow-reboot", "-node.reboot-command=/sbin/shutdown -r now", "-node.exec.cgroup=required"}))
	require.Equal(t, Config{MaxConcurrent: 3, KillGrace: 2 * time.Second, FileRoots: []string{"/srv", "/etc/app"}, FileMaxBytes: 100,
		AllowReboot: true, RebootCommand: []string{"/sbin/shutdown", "-r", "now"}, Cgroup: CgroupRequired}, c)
	require.NoError(t, c.Validate())
	require.ErrorContains(t, fs.Parse([]string{"-node.exec.cgroup=systemd"}), `"systemd" is not one of auto, off, required`)
	require.Equal(t, CgroupRequired, c.Cgroup, "a refused value leaves the flag as it was")
	require.Equal(t, "auto", fs.Lookup("node.exec.cgroup").DefValue)

	bad := DefaultConfig()
	bad.MaxConcurrent, bad.KillGrace, bad.FileRoots, bad.FileMaxBytes, bad.AllowReboot, bad.RebootCommand = 0, 0, []string{"srv", "/a/../b"}, 0, true, nil
	bad.Cgroup = "sometimes"
	err := bad.Validate()
	require.Error(t, err)
	for _, s := range []string{"exec.max-concurrent", "exec.kill-grace", `file.roots: "srv"`, `file.roots: "/a/../b"`, "file.max-bytes", "reboot-command",
		`exec.cgroup must be auto, off or required, got "sometimes"`} {
		require.Contains(t, err.Error(), s)
	}
	_, err = New(bad, nil)
	require.Error(t, err)
}

func TestUnknownKindAndInvalidPayload(t *testing.T) {
	t.Parallel()
	e := newExecutor(t)
	o, _ := handle(t, e, "custom.thing", "x")
	require.Equal(t, int32(-1), o.ExitCode)
	require.Equal(t, `unknown_kind: kind "custom.thing" is not one this node executes (exec, script, file.put, file.get, facts, reboot)`, o.Err)
	o, _ = handle(t, e, "exec", `{"argv":[]}`)
	require.Equal(t, int32(-1), o.ExitCode)
	require.Equal(t, "invalid_payload: payload.argv: must not be empty", o.Err)
}

// TestReboot: refused without AllowReboot; with it, the result comes
// first and the reboot command runs after the delay.
func TestReboot(t *testing.T) {
	t.Parallel()
	e := newExecutor(t)
	o, _ := handle(t, e, "reboot", `{}`)
	require.Equal(t, int32(-1), o.ExitCode)
	require.True(t, strings.HasPrefix(o.Err, "reboot_not_allowed: "), o.Err)
	require.Contains(t, o.Err, "--allow-reboot")

	flagFile := t.TempDir() + "/rebooted"
	e = newExecutor(t, func(c *Config) { c.AllowReboot, c.RebootCommand = true, []string{"touch", flagFile} })
	o, _ = handle(t, e, "reboot", `{"delay":"2s","reason":"test"}`)
	require.Equal(t, int32(0), o.ExitCode, o.Err)
	require.Equal(t, "reboot in 2s: touch "+flagFile+"\n", string(o.Output))
	require.NoFileExists(t, flagFile, "the result comes before the reboot")
	again, _ := handle(t, e, "reboot", `{}`)
	require.Equal(t, int32(0), again.ExitCode, again.Err)
	require.Contains(t, string(again.Output), "a reboot is already scheduled at ")
	require.Eventually(t, func() bool { _, err := os.Stat(flagFile); return err == nil }, 10*time.Second, 10*time.Millisecond)

	// Close cancels a reboot that has not started.
	never := t.TempDir() + "/never"
	e = newExecutor(t, func(c *Config) { c.AllowReboot, c.RebootCommand = true, []string{"touch", never} })
	o, _ = handle(t, e, "reboot", `{"delay":"3600s"}`)
	require.Equal(t, int32(0), o.ExitCode, o.Err)
	e.Close()
	require.NoFileExists(t, never)
}
