package harness

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
)

// LimitCPU puts process pid (its threads move with it) into a cgroup of
// its own whose CPU time is capped at cpus cores, through cgroup v2's
// cpu.max or, on a v1 hierarchy, the cpu controller's CFS quota. It
// returns a function that moves the process back and removes the group.
// A bench uses it to make one tier the bottleneck on a machine whose cores
// every process shares (the throughput bench's overload scenario caps the
// gateways so that what the api admits can outgrow what they complete).
func LimitCPU(name string, pid int, cpus float64) (undo func(), err error) {
	if cpus <= 0 {
		return nil, fmt.Errorf("cpu limit %v must be positive", cpus)
	}
	const period = 100000 // µs
	quota := int(cpus * period)
	type layout struct{ root, limitFile, limit, weightFile, weight string }
	var l layout
	switch {
	case fileExists("/sys/fs/cgroup/cgroup.controllers"):
		l = layout{"/sys/fs/cgroup", "cpu.max", fmt.Sprintf("%d %d", quota, period), "cpu.weight", "10000"}
	case fileExists("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
		l = layout{"/sys/fs/cgroup/cpu", "cpu.cfs_quota_us", strconv.Itoa(quota), "cpu.shares", "262144"}
	default:
		return nil, errors.New("no writable cgroup cpu controller (cgroup v2 cpu.max or v1 cpu.cfs_quota_us)")
	}
	dir := filepath.Join(l.root, "leasehold-bench-"+name)
	if err := os.Mkdir(dir, 0o755); err != nil && !os.IsExist(err) {
		return nil, fmt.Errorf("create cgroup %s: %w", dir, err)
	}
	if err := os.WriteFile(filepath.Join(dir, l.limitFile), []byte(l.limit), 0o644); err != nil {
		_ = os.Remove(dir)
		return nil, fmt.Errorf("cap %s at %v cpus: %w", dir, cpus, err)
	}
	if err := os.WriteFile(filepath.Join(dir, l.weightFile), []byte(l.weight), 0o644); err != nil {
		_ = os.Remove(dir)
		return nil, fmt.Errorf("weight %s: %w", dir, err)
	}
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
		_ = os.Remove(dir)
		return nil, fmt.Errorf("move %d into %s: %w", pid, dir, err)
	}
	return func() {
		_ = os.WriteFile(filepath.Join(l.root, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644)
		_ = os.Remove(dir)
	}, nil
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
