package fleettest

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// TestAddrHandsOutEachPortOnce asks for 2,000 addresses from several
// goroutines at once, as a large bench does, and binds each as soon as it
// is handed out: every one must bind then, none may repeat and none may lie
// in the kernel's ephemeral range. Each is closed again right away, as if
// its process had not started yet or had exited, so a port free again is
// one an allocator that forgot what it handed out could repeat.
func TestAddrHandsOutEachPortOnce(t *testing.T) {
	const workers, each = 8, 250
	lo, hi, rangeErr := ephemeralRange()
	var (
		mu   sync.Mutex
		seen = map[string]bool{}
		wg   sync.WaitGroup
	)
	for range workers {
		wg.Go(func() {
			for range each {
				addr := Addr(t)
				l, err := net.Listen("tcp", addr)
				mu.Lock()
				if seen[addr] {
					t.Errorf("%s handed out twice", addr)
				}
				seen[addr] = true
				mu.Unlock()
				if err != nil {
					t.Errorf("%s was handed out but does not bind: %v", addr, err)
					continue
				}
				_ = l.Close()
			}
		})
	}
	wg.Wait()
	if len(seen) != workers*each {
		t.Errorf("%d distinct addresses, want %d", len(seen), workers*each)
	}
	if rangeErr != nil {
		t.Logf("no ephemeral range to check against: %v", rangeErr)
		return
	}
	for addr := range seen {
		_, p, _ := net.SplitHostPort(addr)
		port, _ := strconv.Atoi(p)
		if port >= lo && port <= hi {
			t.Errorf("%s is in the ephemeral range %d-%d", addr, lo, hi)
		}
	}
}

// TestAddrNeverRepeatsAClosedPort: a port whose process has exited is free
// again, but it is not handed out again by this process.
func TestAddrNeverRepeatsAClosedPort(t *testing.T) {
	first := Addr(t)
	for range 500 {
		if a := Addr(t); a == first {
			t.Fatalf("%s handed out again", a)
		}
	}
}

func TestPortCandidates(t *testing.T) {
	c := portCandidates(32768, 60999)
	if len(c) != (32768-minPort)+(65535-60999) {
		t.Fatalf("%d candidates", len(c))
	}
	if c[0] != minPort || c[len(c)-1] != 65535 {
		t.Fatalf("candidates from %d to %d", c[0], c[len(c)-1])
	}
	for _, p := range c {
		if p >= 32768 && p <= 60999 {
			t.Fatalf("candidate %d is in the ephemeral range", p)
		}
	}
	if n := len(portCandidates(1024, 65535)); n != 0 {
		t.Fatalf("%d candidates when the ephemeral range takes every port", n)
	}
}

func TestParsePortRange(t *testing.T) {
	lo, hi, err := parsePortRange("32768\t60999\n")
	if err != nil || lo != 32768 || hi != 60999 {
		t.Fatalf("got %d %d %v", lo, hi, err)
	}
	for _, bad := range []string{"", "32768", "a b", "60999 32768", "0 100", "1 70000"} {
		if _, _, err := parsePortRange(bad); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

// TestPortsAreReservedAcrossProcesses: a port another live test process
// handed out is not handed out here, and is free to reserve once that
// process has exited. The other process is this test binary run again,
// which hands out one port, prints it and waits for its stdin to close.
func TestPortsAreReservedAcrossProcesses(t *testing.T) {
	if os.Getenv("LEASEHOLD_FLEETTEST_HOLD") != "" {
		port, err := FreePort()
		if err != nil {
			fmt.Println("error:", err)
			os.Exit(1)
		}
		fmt.Println(port)
		_, _ = io.Copy(io.Discard, os.Stdin)
		os.Exit(0)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestPortsAreReservedAcrossProcesses$")
	cmd.Env = append(os.Environ(), "LEASEHOLD_FLEETTEST_HOLD=1")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("the holding process said nothing: %v", err)
	}
	port, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		t.Fatalf("the holding process said %q", line)
	}
	if reserve(port) {
		t.Errorf("port %d was reserved here while another process holds it", port)
	}
	_ = stdin.Close()
	if err := cmd.Wait(); err != nil {
		t.Fatalf("holding process: %v", err)
	}
	if !reserve(port) {
		t.Errorf("port %d is still held after its process exited", port)
	}
}
