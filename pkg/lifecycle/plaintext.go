package lifecycle

import (
	"errors"
	"fmt"
	"net"
	"strings"
)

// InsecurePlaintextFlag is the flag that lets a listener carrying
// credentials or commands serve without TLS on an address other than
// loopback.
const InsecurePlaintextFlag = "insecure-plaintext"

// Listener is one address a program serves that carries credentials or
// commands (ControlService, node streams, the tunnel relay,
// DoctorService). The health and metrics server (--http-addr) is not one:
// it answers unauthenticated callers with no detail, and Prometheus scrapes
// it in plaintext on a cluster network.
type Listener struct {
	// Flag names the address's flag, without dashes (e.g. "listen-addr").
	Flag string
	// Addr is the host:port listened on; empty means the listener is off.
	Addr string
	// TLS reports whether the listener serves TLS.
	TLS bool
	// TLSFlag names the flag that turns TLS on, for the error message.
	TLSFlag string
}

// CheckPlaintext refuses every listener in ls that would serve plaintext on
// an address other than loopback, unless insecure (--insecure-plaintext)
// is set. The error names the listener's flag, its TLS flag and
// --insecure-plaintext.
func CheckPlaintext(ls []Listener, insecure bool) error {
	if insecure {
		return nil
	}
	var errs []error
	for _, l := range ls {
		if l.Addr == "" || l.TLS || Loopback(l.Addr) {
			continue
		}
		errs = append(errs, fmt.Errorf("--%s %q is not a loopback address and serves no TLS: set --%s (or listen on 127.0.0.1), or pass --%s to serve plaintext anyway (only behind a TLS-terminating proxy or on a network you trust)",
			l.Flag, l.Addr, l.TLSFlag, InsecurePlaintextFlag))
	}
	return errors.Join(errs...)
}

// Loopback reports whether addr (host:port) only accepts connections from
// this machine: its host is "localhost" or a loopback IP. An empty host, a
// wildcard address or any other name is not loopback.
func Loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
