package harness

import (
	"os"
	"strconv"
	"strings"
)

// userHZ is the kernel's clock ticks per second in /proc/<pid>/stat
// (USER_HZ, 100 on Linux).
const userHZ = 100

// procStat is what the benches read of /proc/<pid>/stat: CPU ticks (user
// and system; with the reaped children's when withChildren) and the parent
// pid. ok is false for a process that is gone or a line that does not parse.
func procStat(pid string, withChildren bool) (ticks int64, ppid string, ok bool) {
	raw, err := os.ReadFile("/proc/" + pid + "/stat")
	if err != nil {
		return 0, "", false
	}
	// Fields after the command name, which is in parentheses.
	i := strings.LastIndexByte(string(raw), ')')
	if i < 0 || i+2 > len(raw) {
		return 0, "", false
	}
	f := strings.Fields(string(raw[i+2:]))
	if len(f) < 15 {
		return 0, "", false
	}
	// utime, stime, cutime, cstime; a field that does not parse counts 0.
	field := func(i int) int64 { v, _ := strconv.ParseInt(f[i], 10, 64); return v }
	ticks = field(11) + field(12)
	if withChildren {
		ticks += field(13) + field(14)
	}
	return ticks, f[1], true // f[1] is the parent pid
}

// ProcessCPU is the CPU seconds (user + system) process pid and the
// children it has reaped have used so far; ok is false once it is gone.
func ProcessCPU(pid int) (secs float64, ok bool) {
	t, _, ok := procStat(strconv.Itoa(pid), true)
	return float64(t) / userHZ, ok
}

// CPUByRole sums the CPU seconds used so far by the supervisors' running
// processes, keyed by role: a process's name without its trailing number
// ("gateway-2" counts as "gateway"). "bench" is this process (the
// creators). A process that has exited is left out, so compare samples
// taken while the same processes run.
func CPUByRole(sups ...*Supervisor) map[string]float64 {
	out := map[string]float64{}
	if secs, ok := ProcessCPU(os.Getpid()); ok {
		out["bench"] = secs
	}
	for _, s := range sups {
		if s == nil {
			continue
		}
		s.mu.Lock()
		procs := append([]*Proc(nil), s.procs...)
		s.mu.Unlock()
		for _, p := range procs {
			if p.Exited() || p.Cmd.Process == nil {
				continue
			}
			if secs, ok := ProcessCPU(p.Cmd.Process.Pid); ok {
				out[Role(p.Name)] += secs
			}
		}
	}
	return out
}

// Role is a process name without its trailing instance number and dash:
// "gateway-2" and "haproxy1" are "gateway" and "haproxy".
func Role(name string) string {
	return strings.TrimRight(name, "0123456789-")
}
