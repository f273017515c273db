package nodeexec

import (
	"bufio"
	"bytes"
	"net"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/leasehold/leasehold/pkg/daemon"
)

// Facts is the result Output of the facts kind, read from the kernel
// (/proc, /sys, uname, statfs) at the time of the command. Fields the
// node cannot read are left empty rather than failing the command.
type Facts struct {
	Hostname string     `json:"hostname"`
	OS       OSFacts    `json:"os"`
	Kernel   Kernel     `json:"kernel"`
	Arch     string     `json:"arch"`
	CPU      CPU        `json:"cpu"`
	Memory   Memory     `json:"memory"`
	Disks    []Disk     `json:"disks"`
	Network  []NetIface `json:"network"`
	// UptimeSeconds is from /proc/uptime; BootTime from /proc/stat btime.
	UptimeSeconds float64   `json:"uptime_seconds"`
	BootTime      time.Time `json:"boot_time"`
	AgentVersion  string    `json:"agent_version"`
}

// OSFacts is /etc/os-release's ID, VERSION_ID and PRETTY_NAME.
type OSFacts struct {
	ID         string `json:"id"`
	VersionID  string `json:"version_id"`
	PrettyName string `json:"pretty_name"`
}

// Kernel is uname's sysname, release and version.
type Kernel struct {
	Name    string `json:"name"`
	Release string `json:"release"`
	Version string `json:"version"`
}

// CPU is the number of CPUs the agent may use and their model name.
type CPU struct {
	Count int    `json:"count"`
	Model string `json:"model"`
}

// Memory is /proc/meminfo's MemTotal and MemAvailable in bytes.
type Memory struct {
	TotalBytes     uint64 `json:"total_bytes"`
	AvailableBytes uint64 `json:"available_bytes"`
}

// Disk is a mounted filesystem that stores data (pseudo filesystems such
// as proc, sysfs, tmpfs and cgroup are left out). FreeBytes counts the
// blocks reserved for root; AvailableBytes does not.
type Disk struct {
	Device         string `json:"device"`
	Mountpoint     string `json:"mountpoint"`
	FSType         string `json:"fstype"`
	SizeBytes      uint64 `json:"size_bytes"`
	FreeBytes      uint64 `json:"free_bytes"`
	AvailableBytes uint64 `json:"available_bytes"`
}

// NetIface is a network interface with its addresses in CIDR notation.
type NetIface struct {
	Name      string   `json:"name"`
	MAC       string   `json:"mac"`
	MTU       int      `json:"mtu"`
	Up        bool     `json:"up"`
	Addresses []string `json:"addresses"`
}

// pseudoFS are filesystem types that hold no data of the node's.
var pseudoFS = map[string]bool{
	"proc": true, "sysfs": true, "devtmpfs": true, "devpts": true, "tmpfs": true, "securityfs": true,
	"cgroup": true, "cgroup2": true, "pstore": true, "bpf": true, "debugfs": true, "tracefs": true,
	"mqueue": true, "hugetlbfs": true, "configfs": true, "fusectl": true, "autofs": true, "binfmt_misc": true,
	"rpc_pipefs": true, "nsfs": true, "ramfs": true, "efivarfs": true, "selinuxfs": true, "squashfs": true,
	"nfsd": true, "fuse.gvfsd-fuse": true, "fuse.lxcfs": true,
}

func (e *Executor) facts() daemon.Outcome {
	return jsonOutput(e.readFacts())
}

// readFacts gathers the node's facts.
func (e *Executor) readFacts() Facts {
	f := Facts{Arch: runtime.GOARCH, AgentVersion: e.cfg.Version, Disks: []Disk{}, Network: []NetIface{}}
	f.Hostname, _ = os.Hostname()
	f.OS = readOSRelease("/etc/os-release")
	if f.OS == (OSFacts{}) {
		f.OS = readOSRelease("/usr/lib/os-release")
	}
	var u syscall.Utsname
	if syscall.Uname(&u) == nil {
		f.Kernel = Kernel{Name: cstr(u.Sysname[:]), Release: cstr(u.Release[:]), Version: cstr(u.Version[:])}
		f.Arch = cstr(u.Machine[:])
	}
	f.CPU = CPU{Count: runtime.NumCPU(), Model: cpuModel()}
	mem := meminfo()
	f.Memory = Memory{TotalBytes: mem["MemTotal"], AvailableBytes: mem["MemAvailable"]}
	f.Disks = disks()
	f.Network = interfaces()
	if b, err := os.ReadFile("/proc/uptime"); err == nil {
		if fs := strings.Fields(string(b)); len(fs) > 0 {
			f.UptimeSeconds, _ = strconv.ParseFloat(fs[0], 64)
		}
	}
	if b, err := os.ReadFile("/proc/stat"); err == nil {
		for line := range strings.Lines(string(b)) {
			if v, ok := strings.CutPrefix(line, "btime "); ok {
				if s, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil {
					f.BootTime = time.Unix(s, 0).UTC()
				}
			}
		}
	}
	return f
}

// cstr is a NUL-terminated utsname field.
func cstr[T int8 | uint8](b []T) string {
	out := make([]byte, 0, len(b))
	for _, c := range b {
		if c == 0 {
			break
		}
		out = append(out, byte(c))
	}
	return string(out)
}

func readOSRelease(path string) OSFacts {
	var o OSFacts
	b, err := os.ReadFile(path)
	if err != nil {
		return o
	}
	for line := range strings.Lines(string(b)) {
		k, v, ok := strings.Cut(strings.TrimSpace(line), "=")
		if !ok {
			continue
		}
		if uq, err := strconv.Unquote(v); err == nil {
			v = uq
		} else {
			v = strings.Trim(v, `'"`)
		}
		switch k {
		case "ID":
			o.ID = v
		case "VERSION_ID":
			o.VersionID = v
		case "PRETTY_NAME":
			o.PrettyName = v
		}
	}
	return o
}

// cpuModel is the first "model name" (x86), "Model" or "Hardware" (arm),
// or "cpu" (power) of /proc/cpuinfo.
func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return ""
	}
	found := map[string]string{}
	for line := range strings.Lines(string(b)) {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		k = strings.TrimSpace(k)
		if _, seen := found[k]; !seen {
			found[k] = strings.TrimSpace(v)
		}
	}
	for _, k := range []string{"model name", "Model", "Hardware", "cpu"} {
		if v := found[k]; v != "" {
			return v
		}
	}
	return ""
}

// meminfo is /proc/meminfo in bytes.
func meminfo() map[string]uint64 {
	out := map[string]uint64{}
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return out
	}
	for line := range strings.Lines(string(b)) {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		fs := strings.Fields(v)
		if len(fs) == 0 {
			continue
		}
		n, err := strconv.ParseUint(fs[0], 10, 64)
		if err != nil {
			continue
		}
		if len(fs) > 1 && fs[1] == "kB" {
			n *= 1024
		}
		out[k] = n
	}
	return out
}

// disks are the data filesystems of /proc/self/mounts, each mountpoint
// once (the last mount over it wins, as the kernel shows it).
func disks() []Disk {
	out := []Disk{}
	b, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		return out
	}
	seen := map[string]int{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) < 3 || pseudoFS[fs[2]] {
			continue
		}
		mp := unescapeMount(fs[1])
		var st syscall.Statfs_t
		if syscall.Statfs(mp, &st) != nil || st.Blocks == 0 {
			continue
		}
		bs := uint64(st.Bsize) //nolint:gosec // a block size is positive
		d := Disk{Device: unescapeMount(fs[0]), Mountpoint: mp, FSType: fs[2],
			SizeBytes: st.Blocks * bs, FreeBytes: st.Bfree * bs, AvailableBytes: st.Bavail * bs}
		if i, ok := seen[mp]; ok {
			out[i] = d
			continue
		}
		seen[mp] = len(out)
		out = append(out, d)
	}
	return out
}

// unescapeMount undoes the octal escapes of /proc/mounts and
// /proc/self/mountinfo (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func interfaces() []NetIface {
	out := []NetIface{}
	ifs, err := net.Interfaces()
	if err != nil {
		return out
	}
	for _, i := range ifs {
		n := NetIface{Name: i.Name, MAC: i.HardwareAddr.String(), MTU: i.MTU, Up: i.Flags&net.FlagUp != 0, Addresses: []string{}}
		if addrs, err := i.Addrs(); err == nil {
			for _, a := range addrs {
				n.Addresses = append(n.Addresses, a.String())
			}
		}
		slices.Sort(n.Addresses)
		out = append(out, n)
	}
	return out
}
