// Package egress decides which addresses leasehold may send requests to on
// behalf of a user-supplied URL (webhook sinks), so a sink cannot be used to
// reach the control plane's own machine, the cloud metadata service or the
// private network behind it (server-side request forgery).
//
// A Policy is checked twice: when a URL is created (CheckURL: the literal
// host, without DNS) and on every connection (Control, a net.Dialer
// Control func that sees the address actually dialled after DNS
// resolution, so a name that resolves to a public address at creation and
// to 169.254.169.254 later, DNS rebinding, is still refused).
//
// Always refused: unspecified (0.0.0.0/8, ::), link-local (169.254.0.0/16,
// fe80::/10, which holds the metadata service 169.254.169.254), the
// metadata addresses fd00:ec2::254 and 100.100.100.200, multicast,
// broadcast and 240.0.0.0/4. Refused unless allowed: loopback (127.0.0.0/8,
// ::1, "localhost") with AllowLoopback; RFC 1918, RFC 6598 shared space
// (100.64.0.0/10) and IPv6 unique-local (fc00::/7) with AllowPrivate.
// IPv4-mapped IPv6 and NAT64 (64:ff9b::/96) addresses are judged by the
// IPv4 address they carry.
package egress

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"syscall"
)

// Policy says which non-public destinations are allowed. The zero Policy
// allows public addresses only.
type Policy struct {
	// AllowLoopback allows 127.0.0.0/8, ::1 and localhost (tests and
	// single-machine development only).
	AllowLoopback bool
	// AllowPrivate allows RFC 1918, 100.64.0.0/10 and fc00::/7, for
	// receivers on the operator's own network. The metadata addresses stay
	// refused.
	AllowPrivate bool
	// LoopbackFlag and PrivateFlag name the settings that set the two
	// fields (e.g. "--sinks.allow-loopback"), for refusal messages; empty
	// means SettingLoopback and SettingPrivate.
	LoopbackFlag, PrivateFlag string
}

func (p Policy) flag(setting string) string {
	switch {
	case setting == SettingLoopback && p.LoopbackFlag != "":
		return p.LoopbackFlag
	case setting == SettingPrivate && p.PrivateFlag != "":
		return p.PrivateFlag
	}
	return setting
}

// ErrRefused is the error every refusal wraps.
var ErrRefused = errors.New("destination refused by the egress policy")

// RefusedError says which address was refused and why.
type RefusedError struct {
	// Addr is the refused address (or host name).
	Addr string
	// Reason names the range: "loopback", "link-local", "cloud metadata"…
	Reason string
	// Allow names the setting that would allow it, or "" when nothing does.
	Allow string
}

func (e *RefusedError) Error() string {
	msg := fmt.Sprintf("%s is a %s address", e.Addr, e.Reason)
	if e.Allow != "" {
		msg += " (allowed only with " + e.Allow + ")"
	}
	return msg
}

// Unwrap makes errors.Is(err, ErrRefused) true.
func (e *RefusedError) Unwrap() error { return ErrRefused }

var (
	metadata = []netip.Addr{
		netip.MustParseAddr("169.254.169.254"), // AWS, GCP, Azure, OpenStack…
		netip.MustParseAddr("fd00:ec2::254"),   // AWS over IPv6
		netip.MustParseAddr("100.100.100.200"), // Alibaba Cloud
	}
	thisNetwork = netip.MustParsePrefix("0.0.0.0/8")
	reserved    = netip.MustParsePrefix("240.0.0.0/4") // and 255.255.255.255
	shared      = netip.MustParsePrefix("100.64.0.0/10")
	nat64       = netip.MustParsePrefix("64:ff9b::/96")
)

// Setting names used in RefusedError.Allow; callers map them to their flags.
const (
	SettingLoopback = "allow-loopback"
	SettingPrivate  = "allow-private"
)

// CheckAddr returns a *RefusedError when p refuses ip.
func (p Policy) CheckAddr(ip netip.Addr) error {
	ip = ip.Unmap()
	if nat64.Contains(ip) {
		b := ip.As16()
		if err := p.CheckAddr(netip.AddrFrom4([4]byte(b[12:]))); err != nil {
			return err
		}
	}
	refuse := func(reason, allow string) error {
		return &RefusedError{Addr: ip.String(), Reason: reason, Allow: allow}
	}
	for _, m := range metadata {
		if ip == m {
			return refuse("cloud metadata", "")
		}
	}
	switch {
	case !ip.IsValid():
		return refuse("invalid", "")
	case ip.IsUnspecified() || thisNetwork.Contains(ip):
		return refuse("unspecified", "")
	case ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast():
		return refuse("link-local", "")
	case ip.IsMulticast() || ip.IsInterfaceLocalMulticast():
		return refuse("multicast", "")
	case reserved.Contains(ip):
		return refuse("reserved or broadcast", "")
	case ip.IsLoopback():
		if !p.AllowLoopback {
			return refuse("loopback", p.flag(SettingLoopback))
		}
	case ip.IsPrivate() || shared.Contains(ip):
		if !p.AllowPrivate {
			return refuse("private", p.flag(SettingPrivate))
		}
	}
	return nil
}

// CheckURL checks a URL's host as written, without resolving it: an IP
// literal must pass CheckAddr and "localhost" (or a name under .localhost)
// needs AllowLoopback. Names are judged again, resolved, by Control.
func (p Policy) CheckURL(u *url.URL) error {
	host := u.Hostname()
	if ip, err := netip.ParseAddr(host); err == nil {
		return p.CheckAddr(ip)
	}
	if ip := parseLegacyIPv4(host); ip.IsValid() {
		return p.CheckAddr(ip)
	}
	name := strings.TrimSuffix(strings.ToLower(host), ".")
	if (name == "localhost" || strings.HasSuffix(name, ".localhost")) && !p.AllowLoopback {
		return &RefusedError{Addr: host, Reason: "loopback", Allow: p.flag(SettingLoopback)}
	}
	return nil
}

// parseLegacyIPv4 reads the forms inet_aton accepts and netip does not
// ("2130706433", "0x7f.1", "0177.0.0.1"), which some resolvers and HTTP
// clients still turn into addresses; it returns the zero Addr otherwise.
func parseLegacyIPv4(host string) netip.Addr {
	if host == "" || strings.ContainsFunc(host, func(r rune) bool {
		return (r < '0' || r > '9') && r != '.' && r != 'x' && r != 'X' && (r < 'a' || r > 'f') && (r < 'A' || r > 'F')
	}) {
		return netip.Addr{}
	}
	if ip := net.ParseIP(host); ip != nil {
		a, _ := netip.AddrFromSlice(ip)
		return a
	}
	parts := strings.Split(host, ".")
	if len(parts) > 4 {
		return netip.Addr{}
	}
	var vals []uint64
	for _, part := range parts {
		v, err := strconv.ParseUint(part, 0, 32) // 0x.. hex and 0.. octal, as inet_aton
		if err != nil {
			return netip.Addr{}
		}
		vals = append(vals, v)
	}
	var n uint64
	last := len(vals) - 1
	for i, v := range vals[:last] {
		if v > 255 {
			return netip.Addr{}
		}
		n |= v << (24 - 8*i)
	}
	if vals[last] >= 1<<(8*(4-last)) {
		return netip.Addr{}
	}
	n |= vals[last]
	return netip.AddrFrom4([4]byte{byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)})
}

// Control is a net.Dialer Control func: it refuses a connection whose
// resolved address p refuses, before any byte is sent.
func (p Policy) Control(network, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return fmt.Errorf("egress: dial %s %s: %w", network, address, err)
	}
	if err := p.CheckAddr(ap.Addr()); err != nil {
		return fmt.Errorf("egress: dial %s: %w", address, err)
	}
	return nil
}
