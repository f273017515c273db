package nodeexec

import (
	"errors"
	"flag"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// Defaults (docs/decisions.md, "Typed command kinds on the node").
const (
	DefaultMaxConcurrent = 8
	DefaultKillGrace     = 10 * time.Second
	DefaultFileMaxBytes  = 16 << 20
	// DefaultRebootDelay is the delay of a reboot whose payload has none:
	// time for the result to reach the gateway before the node goes down.
	DefaultRebootDelay = 5 * time.Second
	// ResultTailBytes is how much of a command's combined output its
	// result keeps (the end); all of it is in the live output.
	ResultTailBytes = 64 << 10
)

// DefaultRebootCommand is the argv run to reboot the node.
var DefaultRebootCommand = []string{"systemctl", "reboot"}

// Config is what an operator decides about the node's executor.
type Config struct {
	// MaxConcurrent bounds the exec and script commands running at once
	// (8); the rest wait on the node in arrival order.
	MaxConcurrent int
	// KillGrace is how long a process group has between SIGTERM and
	// SIGKILL when a command is cancelled or times out, or when processes
	// are left in its group after its main process exited (10 s).
	KillGrace time.Duration
	// FileRoots are the absolute directories file.put and file.get may
	// touch (a file inside one, at any depth, after resolving symlinks);
	// none by default, which refuses every file command.
	FileRoots []string
	// FileMaxBytes bounds the file a file.put writes or a file.get reads
	// (16 MiB).
	FileMaxBytes int64
	// AllowReboot lets the reboot kind reboot the node; off by default,
	// which refuses it.
	AllowReboot bool
	// RebootCommand is the argv run to reboot (systemctl reboot).
	RebootCommand []string
	// Version is the agent version reported by facts; empty means the
	// build's (pkg/buildinfo).
	Version string
	// Cgroup says whether each exec and script command runs in a cgroup
	// v2 of its own as well as in its process group (CgroupAuto).
	Cgroup CgroupMode

	// cgroupPaths replaces /proc/self/mountinfo and /proc/self/cgroup in
	// tests; zero means those.
	cgroupPaths cgroupPaths
}

// CgroupMode is how commands use cgroups: CgroupAuto, CgroupOff or
// CgroupRequired (the exec.cgroup flag).
type CgroupMode string

const (
	// CgroupAuto runs each command in a cgroup of its own when the agent's
	// cgroup v2 is usable (cgroup2 mounted, the agent's cgroup its own and
	// writable, cgroup.kill present: Linux 5.14), and in its process group
	// only otherwise, saying why once at start (info).
	CgroupAuto CgroupMode = "auto"
	// CgroupOff runs each command in its process group only.
	CgroupOff CgroupMode = "off"
	// CgroupRequired is CgroupAuto that refuses to start, naming the
	// reason, when cgroup v2 is not usable.
	CgroupRequired CgroupMode = "required"
)

// String implements flag.Value.
func (m *CgroupMode) String() string {
	if m == nil {
		return ""
	}
	return string(*m)
}

// Set implements flag.Value: auto, off or required.
func (m *CgroupMode) Set(s string) error {
	switch v := CgroupMode(strings.TrimSpace(s)); v {
	case CgroupAuto, CgroupOff, CgroupRequired:
		*m = v
		return nil
	}
	return fmt.Errorf("%q is not one of auto, off, required", s)
}

// DefaultConfig returns the defaults: 8 concurrent commands, a 10 s kill
// grace, no file roots, 16 MiB files, reboot refused, systemctl reboot, a
// cgroup per command where cgroup v2 is usable.
func DefaultConfig() Config {
	return Config{
		MaxConcurrent: DefaultMaxConcurrent,
		KillGrace:     DefaultKillGrace,
		FileMaxBytes:  DefaultFileMaxBytes,
		RebootCommand: append([]string(nil), DefaultRebootCommand...),
		Cgroup:        CgroupAuto,
	}
}

// RegisterFlags registers the executor's flags under prefix (for example
// "" or "node."): exec.max-concurrent, exec.kill-grace, exec.cgroup,
// file.roots, file.max-bytes, allow-reboot, reboot-command. The current values of c
// are the flags' defaults.
func (c *Config) RegisterFlags(prefix string, f *flag.FlagSet) {
	f.IntVar(&c.MaxConcurrent, prefix+"exec.max-concurrent", c.MaxConcurrent, "exec and script commands running at once; the rest wait on the node")
	f.DurationVar(&c.KillGrace, prefix+"exec.kill-grace", c.KillGrace, "time between SIGTERM and SIGKILL to a command's process group on cancel, timeout, or leftovers after it exits")
	f.Var(&c.Cgroup, prefix+"exec.cgroup", "auto, off or required: run each exec and script command in a cgroup v2 of its own, so that cancel, timeout and its end kill everything it started (setsid'd daemons too); auto falls back to its process group where cgroup v2 is not usable (it logs why), required refuses to start there")
	f.Func(prefix+"file.roots", "comma-separated absolute directories file.put and file.get may touch; empty refuses file commands", func(s string) error {
		c.FileRoots = nil
		for r := range strings.SplitSeq(s, ",") {
			if r = strings.TrimSpace(r); r != "" {
				c.FileRoots = append(c.FileRoots, r)
			}
		}
		return nil
	})
	f.Int64Var(&c.FileMaxBytes, prefix+"file.max-bytes", c.FileMaxBytes, "largest file a file.put writes or a file.get reads")
	f.BoolVar(&c.AllowReboot, prefix+"allow-reboot", c.AllowReboot, "let the reboot command kind reboot this node")
	f.Func(prefix+"reboot-command", "the command run to reboot, its arguments separated by spaces (default \""+strings.Join(DefaultRebootCommand, " ")+"\")", func(s string) error {
		c.RebootCommand = strings.Fields(s)
		return nil
	})
}

// Validate refuses a configuration the executor cannot honour, naming the
// flag.
func (c Config) Validate() error {
	var errs []error
	if c.MaxConcurrent < 1 {
		errs = append(errs, fmt.Errorf("exec.max-concurrent must be at least 1, got %d", c.MaxConcurrent))
	}
	if c.KillGrace <= 0 || c.KillGrace > 10*time.Minute {
		errs = append(errs, fmt.Errorf("exec.kill-grace must be in (0, 10m], got %s", c.KillGrace))
	}
	for _, r := range c.FileRoots {
		if !filepath.IsAbs(r) || filepath.Clean(r) != r {
			errs = append(errs, fmt.Errorf("file.roots: %s must be an absolute, clean directory", strconv.Quote(r)))
		}
	}
	if c.FileMaxBytes < 1 {
		errs = append(errs, fmt.Errorf("file.max-bytes must be at least 1, got %d", c.FileMaxBytes))
	}
	switch c.Cgroup {
	case "", CgroupAuto, CgroupOff, CgroupRequired:
	default:
		errs = append(errs, fmt.Errorf("exec.cgroup must be auto, off or required, got %q", c.Cgroup))
	}
	if c.AllowReboot && len(c.RebootCommand) == 0 {
		errs = append(errs, errors.New("reboot-command must not be empty with allow-reboot"))
	}
	return errors.Join(errs...)
}
