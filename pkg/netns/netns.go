// Package netns gives tests and benches a host that can vanish: a network
// namespace joined to this host by a veth pair, in which a process runs and
// whose link can then be cut so that every packet between it and the host
// is lost silently (no FIN, no RST, no ICMP), as when a machine loses power
// or its switch port. A loopback proxy cannot fake this: the proxy's own
// connection to PostgreSQL stays alive, so the server never notices.
//
// It needs root and the ip(8) command (iproute2); Available says why not.
package netns

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"time"
)

// Namespace is a network namespace with one veth link to the host: the host
// end has HostAddr, the namespace end NSAddr, both in Subnet (a /30).
type Namespace struct {
	// Name is the namespace's name (ip netns).
	Name string
	// HostAddr is the host's address on the link: what a process inside
	// connects to (a server must listen on it).
	HostAddr string
	// NSAddr is the namespace's address: what the host reaches a process
	// inside on.
	NSAddr string
	// Subnet is the link's network in CIDR form, for pg_hba.conf.
	Subnet string
	hostIf string
	closed atomic.Bool
}

// Available returns nil when namespaces can be made here, else an error
// saying why not (not root, no ip command, or the kernel refuses), for a
// clean skip.
func Available() error {
	if os.Geteuid() != 0 {
		return errors.New("network namespaces need root")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return errors.New("the ip command (iproute2) is missing")
	}
	return nil
}

var seq atomic.Uint32

// New creates a namespace and its veth pair. index (0-255) picks the link's
// subnet 10.213.<index>.0/30, so concurrent users must pass distinct ones.
// Close removes both.
func New(ctx context.Context, index int) (*Namespace, error) {
	if err := Available(); err != nil {
		return nil, err
	}
	if index < 0 || index > 255 {
		return nil, fmt.Errorf("netns: index %d outside 0-255", index)
	}
	n := seq.Add(1)
	tag := fmt.Sprintf("%d%d", os.Getpid()%100000, n)
	ns := &Namespace{
		Name:     "lhvan" + tag,
		HostAddr: fmt.Sprintf("10.213.%d.1", index),
		NSAddr:   fmt.Sprintf("10.213.%d.2", index),
		Subnet:   fmt.Sprintf("10.213.%d.0/30", index),
		hostIf:   "lhv" + tag,
	}
	if len(ns.hostIf) > 15 {
		ns.hostIf = ns.hostIf[:15]
	}
	if err := ip(ctx, "netns", "add", ns.Name); err != nil {
		return nil, fmt.Errorf("netns: the kernel refuses network namespaces here: %w", err)
	}
	steps := [][]string{
		{"link", "add", ns.hostIf, "type", "veth", "peer", "name", "eth0", "netns", ns.Name},
		{"addr", "add", ns.HostAddr + "/30", "dev", ns.hostIf},
		{"link", "set", ns.hostIf, "up"},
		{"-n", ns.Name, "addr", "add", ns.NSAddr + "/30", "dev", "eth0"},
		{"-n", ns.Name, "link", "set", "eth0", "up"},
		{"-n", ns.Name, "link", "set", "lo", "up"},
	}
	for _, s := range steps {
		if err := ip(ctx, s...); err != nil {
			ns.Close()
			return nil, fmt.Errorf("netns: set up %s: %w", ns.Name, err)
		}
	}
	return ns, nil
}

// Command returns the program and arguments that run bin with args inside
// the namespace (ip netns exec execs bin, so its pid is the process's).
func (ns *Namespace) Command(bin string, args ...string) (string, []string) {
	return "ip", append([]string{"netns", "exec", ns.Name, bin}, args...)
}

// Vanish cuts the link: the host end goes down, so from then on every packet
// either way is dropped without a word to either side. Processes inside keep
// running.
func (ns *Namespace) Vanish(ctx context.Context) error {
	if err := ip(ctx, "link", "set", ns.hostIf, "down"); err != nil {
		return fmt.Errorf("netns: cut %s: %w", ns.Name, err)
	}
	return nil
}

// Restore brings the link back up after Vanish, for the next run of a
// bench; connections cut meanwhile stay broken.
func (ns *Namespace) Restore(ctx context.Context) error {
	if err := ip(ctx, "link", "set", ns.hostIf, "up"); err != nil {
		return fmt.Errorf("netns: restore %s: %w", ns.Name, err)
	}
	return nil
}

// Close deletes the namespace (and with it the veth pair). Processes still
// inside lose their network; stop them first.
func (ns *Namespace) Close() {
	if ns.closed.Swap(true) {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = ip(ctx, "link", "del", ns.hostIf)
	_ = ip(ctx, "netns", "del", ns.Name)
}

func ip(ctx context.Context, args ...string) error {
	out, err := exec.CommandContext(ctx, "ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}
