package pxe

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
)

// Profile is what a machine boots: kernel and initrd by sha256 digest (both
// served from the image cache) and the kernel command line.
type Profile struct {
	Kernel  string `json:"kernel"`
	Initrd  string `json:"initrd"`
	Cmdline string `json:"cmdline"`
}

// Validate checks the digests and the command line (one line of printable
// ASCII, so a profile can never add commands to the script).
func (p Profile) Validate() error {
	for _, d := range []string{p.Kernel, p.Initrd} {
		if !ValidDigest(d) {
			return fmt.Errorf("digest %q is not 64 lowercase hex characters", d)
		}
	}
	if len(p.Cmdline) > 2048 {
		return errors.New("cmdline longer than 2048 bytes")
	}
	for _, c := range p.Cmdline {
		if c < 0x20 || c > 0x7e {
			return fmt.Errorf("cmdline holds a non-printable character %q", c)
		}
	}
	return nil
}

// ValidDigest reports whether d is a lowercase hex sha256.
func ValidDigest(d string) bool {
	if len(d) != 64 || strings.ToLower(d) != d {
		return false
	}
	_, err := hex.DecodeString(d)
	return err == nil
}

// Hosts maps known MACs to profiles; Default boots unknown machines (for
// example an inventory image). A nil Default means unknown machines get a
// script that waits and retries.
type Hosts struct {
	mu    sync.RWMutex
	byMAC map[string]Profile
	dflt  *Profile
}

// HostsFile is the JSON form of Hosts.
type HostsFile struct {
	Default *Profile           `json:"default,omitempty"`
	Hosts   map[string]Profile `json:"hosts"`
}

// NewHosts returns an empty table.
func NewHosts() *Hosts { return &Hosts{byMAC: map[string]Profile{}} }

// Load replaces the table with f after validating every entry.
func (h *Hosts) Load(f HostsFile) error {
	byMAC := make(map[string]Profile, len(f.Hosts))
	for k, p := range f.Hosts {
		mac, err := ParseMAC(k)
		if err != nil {
			return fmt.Errorf("hosts: %w", err)
		}
		if err := p.Validate(); err != nil {
			return fmt.Errorf("hosts[%s]: %w", k, err)
		}
		byMAC[mac.String()] = p
	}
	if f.Default != nil {
		if err := f.Default.Validate(); err != nil {
			return fmt.Errorf("hosts default: %w", err)
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.byMAC, h.dflt = byMAC, f.Default
	return nil
}

// LoadFile reads a HostsFile from path.
func (h *Hosts) LoadFile(path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("read --boot.hosts-file: %w", err)
	}
	var f HostsFile
	if err := json.Unmarshal(b, &f); err != nil {
		return fmt.Errorf("parse --boot.hosts-file %s: %w", path, err)
	}
	return h.Load(f)
}

// Lookup returns mac's profile and whether mac is a known machine.
func (h *Hosts) Lookup(mac net.HardwareAddr) (Profile, bool, bool) {
	h.mu.RLock()
	defer h.mu.RUnlock()
	if p, ok := h.byMAC[mac.String()]; ok {
		return p, true, true
	}
	if h.dflt != nil {
		return *h.dflt, false, true
	}
	return Profile{}, false, false
}

// Known reports whether mac has its own profile.
func (h *Hosts) Known(mac net.HardwareAddr) bool {
	_, known, _ := h.Lookup(mac)
	return known
}

// ParseMAC accepts aa:bb:cc:dd:ee:ff or aa-bb-cc-dd-ee-ff of a 6-byte
// unicast address.
func ParseMAC(s string) (net.HardwareAddr, error) {
	if len(s) != 17 {
		return nil, fmt.Errorf("MAC %q must be 6 bytes as aa:bb:cc:dd:ee:ff", truncate(s, 40))
	}
	mac, err := net.ParseMAC(s)
	if err != nil || !ValidMAC(mac) {
		return nil, fmt.Errorf("MAC %q is not a 6-byte unicast address", truncate(s, 40))
	}
	return mac, nil
}

func truncate(s string, n int) string {
	if len(s) > n {
		return strings.ToValidUTF8(s[:n], "") + "…"
	}
	return s
}

// ImageURL is where the image cache serves digest under base.
func ImageURL(base, digest string) string {
	return strings.TrimRight(base, "/") + "/images/sha256/" + digest
}

// Script renders the iPXE script booting p with images from base.
func Script(base string, p Profile) string {
	var b strings.Builder
	b.WriteString("#!ipxe\n")
	fmt.Fprintf(&b, "kernel %s", ImageURL(base, p.Kernel))
	if p.Cmdline != "" {
		b.WriteString(" " + p.Cmdline)
	}
	b.WriteString("\n")
	fmt.Fprintf(&b, "initrd %s\n", ImageURL(base, p.Initrd))
	b.WriteString("boot\n")
	return b.String()
}

// WaitScript is served to a machine with no profile: it waits and asks again.
const WaitScript = "#!ipxe\necho no boot profile for ${net0/mac} yet; retrying in 30 s\nsleep 30\nchain ${0}\n"
