package nodeexec

import (
	"strings"
	"time"
)

// The layout of the cgroup the agent owns (cgroup_linux.go): the agent
// itself in cgroupLeaf, each command in cgroupCmdPrefix plus its id.
const (
	cgroupLeaf      = "agent"
	cgroupCmdPrefix = "cmd-"
	cgroupProbe     = "leasehold-probe"
	// cgroupNameMax bounds the id part of a command's cgroup name (a
	// directory name: 255 bytes at most).
	cgroupNameMax = 128
	// cgroupSettle bounds the wait for a killed cgroup to empty: the
	// kernel empties it within milliseconds unless a process is in
	// uninterruptible sleep, which no signal ends.
	cgroupSettle = 5 * time.Second
)

// cgroupPaths are the files that tell the agent where cgroup v2 is mounted
// and which cgroup it is in; tests point them elsewhere.
type cgroupPaths struct {
	mountinfo string // /proc/self/mountinfo
	self      string // /proc/self/cgroup
}

func (p cgroupPaths) orDefault() cgroupPaths {
	if p.mountinfo == "" {
		p.mountinfo = "/proc/self/mountinfo"
	}
	if p.self == "" {
		p.self = "/proc/self/cgroup"
	}
	return p
}

// cgroupName is the cgroup directory name of command id: cgroupCmdPrefix,
// then the id with every byte but letters, digits, '.', '_' and '-'
// replaced by '_', cut to cgroupNameMax bytes.
func cgroupName(id string) string {
	var b strings.Builder
	b.WriteString(cgroupCmdPrefix)
	for i := 0; i < len(id) && i < cgroupNameMax; i++ {
		c := id[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.', c == '_', c == '-':
			b.WriteByte(c)
		default:
			b.WriteByte('_')
		}
	}
	if len(id) == 0 {
		b.WriteString("unnamed")
	}
	return b.String()
}
