package fleettest

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// Ports for processes that bind them later.
//
// A port is free only until someone binds it, and Addr hands ports to
// processes that bind them seconds later. Asking the kernel for port 0,
// reading the port and closing the listener, as pglocal.FreePort does,
// returns a port of the kernel's ephemeral range: the very range it picks
// the local port of every outgoing connection from. A run with many
// processes opens many connections (each member's pool to PostgreSQL), so
// one of them can take the port in between, or the kernel can hand the same
// just-closed port to a second caller; either way a process fails with
// "bind: address already in use".
//
// So the ports come from outside the ephemeral range
// (/proc/sys/net/ipv4/ip_local_port_range), where the kernel never picks an
// outgoing connection's port, in an order shuffled per process (two test
// binaries running at once rarely try the same port near the same time),
// and each candidate is tried once per process: handed out when a listener
// could bind it that moment, skipped for good otherwise. No port is ever
// handed out twice by one process, even after the process it went to has
// exited. Only when too few ports lie outside the ephemeral range does it
// fall back to asking the kernel, still never repeating a port.
//
// Test binaries run side by side (go test runs packages in parallel), and
// each binary's shuffled order only makes a clash rare. So a port is also
// reserved across processes before it is handed out: an exclusive flock on
// a file named for it in a directory every test process shares, held until
// the process exits (the kernel drops the lock then, even on SIGKILL). A
// port another live process reserved is skipped. Where the directory
// cannot be used (another user's, a read-only /tmp) the reservation is
// left out and the per-process order is all there is.
var ports struct {
	sync.Mutex
	// order holds the candidates in this process's order (nil until first
	// use); next is the index of the next one to try. A candidate is tried
	// once: the cursor never goes back.
	order []int
	next  int
	// handedOut holds the ports the fallback returned.
	handedOut map[int]bool
}

// minPort is the lowest port handed out: below it are the ports well-known
// services listen on by default.
const minPort = 10000

// minCandidates is the fewest ports outside the ephemeral range worth
// using; with fewer, FreePort asks the kernel instead.
const minCandidates = 4096

// FreePort returns a TCP port that was free on 127.0.0.1 a moment ago, that
// the kernel does not pick for outgoing connections, and that no earlier
// FreePort or Addr call in this process returned.
func FreePort() (int, error) {
	ports.Lock()
	defer ports.Unlock()
	if ports.order == nil {
		lo, hi, err := ephemeralRange()
		if err != nil {
			// Not Linux: assume the IANA dynamic range other systems use.
			lo, hi = 49152, 65535
		}
		ports.order = portCandidates(lo, hi)
		rand.Shuffle(len(ports.order), func(i, j int) { ports.order[i], ports.order[j] = ports.order[j], ports.order[i] })
		ports.handedOut = map[int]bool{}
	}
	if len(ports.order) < minCandidates {
		return kernelPort()
	}
	for ports.next < len(ports.order) {
		port := ports.order[ports.next]
		ports.next++
		if reserve(port) && bindable(port) {
			return port, nil
		}
	}
	return 0, fmt.Errorf("fleettest: all %d loopback ports outside the ephemeral range were handed out or busy", len(ports.order))
}

// kernelPort is FreePort's fallback: the kernel's choice, skipping ports
// this process handed out already. ports is locked.
func kernelPort() (int, error) {
	for range 100 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, fmt.Errorf("fleettest: find a free port: %w", err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		_ = l.Close()
		if !ports.handedOut[port] && reserve(port) {
			ports.handedOut[port] = true
			return port, nil
		}
	}
	return 0, errors.New("fleettest: no free loopback port that was not handed out already")
}

// bindable reports whether a listener can bind 127.0.0.1:port now.
func bindable(port int) bool {
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		return false
	}
	_ = l.Close()
	return true
}

// ephemeralRange reads the kernel's range of local ports for outgoing
// connections.
func ephemeralRange() (lo, hi int, err error) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0, 0, err
	}
	return parsePortRange(string(b))
}

func parsePortRange(s string) (lo, hi int, err error) {
	f := strings.Fields(s)
	if len(f) != 2 {
		return 0, 0, fmt.Errorf("port range %q: want two numbers", s)
	}
	if lo, err = strconv.Atoi(f[0]); err != nil {
		return 0, 0, fmt.Errorf("port range %q: %w", s, err)
	}
	if hi, err = strconv.Atoi(f[1]); err != nil {
		return 0, 0, fmt.Errorf("port range %q: %w", s, err)
	}
	if lo < 1 || hi > 65535 || lo > hi {
		return 0, 0, fmt.Errorf("port range %q: not a range of ports", s)
	}
	return lo, hi, nil
}

// portCandidates lists the ports from minPort to 65535 outside [lo, hi],
// in ascending order.
func portCandidates(lo, hi int) []int {
	var out []int
	for p := minPort; p <= 65535; p++ {
		if p < lo || p > hi {
			out = append(out, p)
		}
	}
	return out
}

// reservations holds the open lock files of the ports this process
// reserved; they are never closed, so the locks last as long as the
// process.
var reservations struct {
	sync.Mutex
	dir   string
	ready bool
	files []*os.File
}

// reserveDir is where the ports' lock files live.
func reserveDir() string { return filepath.Join(os.TempDir(), "leasehold-test-ports") }

// reserve takes port for this process across every test process on the
// machine: false when another live process holds it. It says true when no
// reservation can be made at all (see above).
func reserve(port int) bool {
	reservations.Lock()
	defer reservations.Unlock()
	if !reservations.ready {
		reservations.ready = true
		dir := reserveDir()
		if err := os.MkdirAll(dir, 0o777); err == nil {
			reservations.dir = dir
		}
	}
	if reservations.dir == "" {
		return true
	}
	f, err := os.OpenFile(filepath.Join(reservations.dir, strconv.Itoa(port)), os.O_CREATE|os.O_RDWR, 0o666)
	if err != nil {
		return true // not ours to lock: no reservation, as documented
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		_ = f.Close()
		return false
	}
	reservations.files = append(reservations.files, f)
	return true
}
