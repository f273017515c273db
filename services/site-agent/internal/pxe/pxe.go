// Package pxe is the site agent's boot server: a proxy DHCP responder
// (github.com/insomniacslk/dhcp) that answers PXE clients with a boot file,
// and the per-MAC iPXE scripts that chain a kernel and an initrd from the
// image cache.
//
// A proxy DHCP server hands out no addresses (the site's ordinary DHCP server
// does that): it answers only DISCOVER and REQUEST packets whose vendor class
// (option 60) starts with "PXEClient", with next-server, boot file (options
// 66/67), vendor class "PXEClient" and PXE discovery control "use the boot
// file". A firmware PXE ROM gets the iPXE binary for its architecture over
// TFTP (client architecture 0: BIOS; 7 and 9: x64 UEFI); UEFI HTTP boot
// (vendor class "HTTPClient", architecture 16) gets the HTTP URL of the
// x64 iPXE binary with "HTTPClient" echoed; iPXE itself (user class "iPXE")
// gets the HTTP URL of its script. Any other architecture is dropped with a
// log line: there is no binary for it.
//
// The responder answers only while its Gate says so (the agent holds a live
// boot grant); otherwise every packet is dropped. Anything malformed (not a
// BOOTREQUEST, not Ethernet, a MAC that is not a 6-byte unicast address) is
// dropped without a reply.
package pxe

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"

	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/insomniacslk/dhcp/dhcpv4/server4"
	"github.com/insomniacslk/dhcp/iana"
	"github.com/prometheus/client_golang/prometheus"
)

// Config configures the responder.
type Config struct {
	// ListenAddr is the UDP address (0.0.0.0:67 on a site; loopback and a
	// high port in tests).
	ListenAddr string
	// PXEListenAddr is the PXE boot server port (0.0.0.0:4011), where
	// clients that got a proxy offer send their ProxyDHCP REQUEST (iPXE
	// waits about 20 s for an answer there before using the offer anyway);
	// empty disables it.
	PXEListenAddr string
	// Interface, when set, binds the socket to that interface.
	Interface string
	// ServerIP is the agent's address on the provisioning network: server
	// identifier (54) and next-server (siaddr).
	ServerIP net.IP
	// TFTPServer is option 66 (default: ServerIP).
	TFTPServer string
	// BootFileBIOS and BootFileEFI are the iPXE binaries for firmware PXE.
	BootFileBIOS, BootFileEFI string
	// ScriptBaseURL is the HTTP base (http://ip:port) of the iPXE scripts.
	ScriptBaseURL string
}

// Validate checks the configuration.
func (c Config) Validate() error {
	var errs []error
	if _, err := net.ResolveUDPAddr("udp4", c.ListenAddr); err != nil || c.ListenAddr == "" {
		errs = append(errs, fmt.Errorf("--dhcp.listen-addr %q is not a UDP address", c.ListenAddr))
	}
	if _, err := net.ResolveUDPAddr("udp4", c.PXEListenAddr); c.PXEListenAddr != "" && err != nil {
		errs = append(errs, fmt.Errorf("--dhcp.pxe-listen-addr %q is not a UDP address", c.PXEListenAddr))
	}
	if c.ServerIP.To4() == nil || c.ServerIP.IsUnspecified() {
		errs = append(errs, fmt.Errorf("--dhcp.server-ip %q must be the agent's IPv4 address on the provisioning network", c.ServerIP))
	}
	if c.BootFileBIOS == "" || c.BootFileEFI == "" || len(c.BootFileBIOS) > 127 || len(c.BootFileEFI) > 127 {
		errs = append(errs, errors.New("--dhcp.boot-file-bios and --dhcp.boot-file-efi must be 1..127 bytes"))
	}
	if !strings.HasPrefix(c.ScriptBaseURL, "http://") && !strings.HasPrefix(c.ScriptBaseURL, "https://") {
		errs = append(errs, fmt.Errorf("iPXE script base URL %q must be http(s)://", c.ScriptBaseURL))
	}
	return errors.Join(errs...)
}

// Gate says whether the agent may answer now, and at which boot epoch.
type Gate func() (epoch uint64, ok bool)

// Request is what a PXE client told us, for discovery.
type Request struct {
	MAC          net.HardwareAddr
	Arch         string
	UUID         []byte
	VendorClass  string
	IPXE         bool
	MessageType  string
	BootEpoch    uint64
	RelayAgentIP net.IP
}

// Responder answers PXE clients.
type Responder struct {
	cfg    Config
	gate   Gate
	onBoot func(Request)
	log    *slog.Logger
	m      *metrics
	conns  []net.PacketConn
	srvs   []*server4.Server
}

type metrics struct {
	packets *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{packets: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "leasehold_site_dhcp_packets_total",
		Help: "DHCP packets by outcome: answered, standby (not active: dropped), ignored (not PXE or not for us), unknown_arch (no boot file for the client's architecture), malformed.",
	}, []string{"outcome"})}
	if reg != nil {
		reg.MustRegister(m.packets)
	}
	return m
}

// New returns a responder; onBoot (optional) is called for every PXE
// request answered.
func New(cfg Config, gate Gate, onBoot func(Request), log *slog.Logger, reg prometheus.Registerer) *Responder {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.TFTPServer == "" && cfg.ServerIP != nil {
		cfg.TFTPServer = cfg.ServerIP.String()
	}
	return &Responder{cfg: cfg, gate: gate, onBoot: onBoot, log: log, m: newMetrics(reg)}
}

// Listen opens the UDP sockets (DHCP, and the PXE boot server port when
// configured); Serve then answers until Close.
func (r *Responder) Listen() error {
	for _, l := range []struct{ flag, addr string }{{"--dhcp.listen-addr", r.cfg.ListenAddr}, {"--dhcp.pxe-listen-addr", r.cfg.PXEListenAddr}} {
		if l.addr == "" {
			continue
		}
		addr, err := net.ResolveUDPAddr("udp4", l.addr)
		if err != nil {
			_ = r.Close()
			return fmt.Errorf("%s %s: %w", l.flag, l.addr, err)
		}
		conn, err := server4.NewIPv4UDPConn(r.cfg.Interface, addr)
		if err != nil {
			_ = r.Close()
			return fmt.Errorf("listen for DHCP on %s: %w", l.addr, err)
		}
		srv, err := server4.NewServer(r.cfg.Interface, addr, r.handle, server4.WithConn(conn))
		if err != nil {
			_ = conn.Close()
			_ = r.Close()
			return fmt.Errorf("dhcp server: %w", err)
		}
		r.conns, r.srvs = append(r.conns, conn), append(r.srvs, srv)
	}
	return nil
}

// Addr is the bound DHCP address once listening.
func (r *Responder) Addr() *net.UDPAddr {
	if len(r.conns) == 0 {
		return nil
	}
	a, _ := r.conns[0].LocalAddr().(*net.UDPAddr)
	return a
}

// PXEAddr is the bound PXE boot server address (port 4011), if any.
func (r *Responder) PXEAddr() *net.UDPAddr {
	if len(r.conns) < 2 {
		return nil
	}
	a, _ := r.conns[1].LocalAddr().(*net.UDPAddr)
	return a
}

// Serve answers packets until Close; it returns the first socket error.
func (r *Responder) Serve() error {
	errc := make(chan error, len(r.srvs))
	for _, srv := range r.srvs {
		go func() { errc <- srv.Serve() }()
	}
	err := <-errc
	_ = r.Close()
	for range len(r.srvs) - 1 {
		<-errc // after Close, the others' ends are expected; the first error is the one returned
	}
	return err
}

// Close stops serving.
func (r *Responder) Close() error {
	var errs []error
	for _, srv := range r.srvs {
		if err := srv.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// handle is the server4 handler: one parsed packet.
func (r *Responder) handle(conn net.PacketConn, peer net.Addr, req *dhcpv4.DHCPv4) {
	reply, _ := r.Reply(req)
	if reply == nil {
		return
	}
	to := replyAddr(peer, req)
	if _, err := conn.WriteTo(reply.ToBytes(), to); err != nil {
		r.log.Warn("send proxy DHCP reply", "mac", req.ClientHWAddr.String(), "err", err)
		return
	}
	r.log.Debug("proxy DHCP reply sent", "mac", req.ClientHWAddr.String(), "message", reply.MessageType().String(),
		"from", conn.LocalAddr().String(), "to", to.String())
}

// replyAddr is where a reply goes: the relay (giaddr, port 67) when
// relayed, else the peer (server4 already turned 0.0.0.0 into broadcast).
func replyAddr(peer net.Addr, req *dhcpv4.DHCPv4) net.Addr {
	if gi := req.GatewayIPAddr; gi != nil && !gi.IsUnspecified() && gi.To4() != nil {
		return &net.UDPAddr{IP: gi, Port: dhcpv4.ServerPort}
	}
	return peer
}

// HandlePacket parses raw bytes and returns the reply's bytes, or nil when
// nothing is to be sent. It never panics on any input (fuzzed).
func (r *Responder) HandlePacket(b []byte) []byte {
	req, err := dhcpv4.FromBytes(b)
	if err != nil {
		r.m.packets.WithLabelValues("malformed").Inc()
		r.log.Warn("DHCP packet dropped: does not parse", "bytes", len(b), "err", err)
		return nil
	}
	reply, _ := r.Reply(req)
	if reply == nil {
		return nil
	}
	return reply.ToBytes()
}

// ValidMAC reports whether hw is a 6-byte unicast MAC that is not all zero.
func ValidMAC(hw net.HardwareAddr) bool {
	if len(hw) != 6 || hw[0]&1 == 1 {
		return false
	}
	for _, b := range hw {
		if b != 0 {
			return true
		}
	}
	return false
}

// Reply decides the answer to req: nil when it must not be answered.
func (r *Responder) Reply(req *dhcpv4.DHCPv4) (*dhcpv4.DHCPv4, *Request) {
	if req == nil || req.OpCode != dhcpv4.OpcodeBootRequest || req.HWType != iana.HWTypeEthernet || !ValidMAC(req.ClientHWAddr) {
		r.m.packets.WithLabelValues("malformed").Inc()
		if req != nil {
			r.log.Warn("DHCP packet dropped: not an Ethernet BOOTREQUEST from a unicast MAC", "op", req.OpCode.String(),
				"htype", req.HWType.String(), "chaddr", fmt.Sprintf("%x", []byte(req.ClientHWAddr)))
		}
		return nil, nil
	}
	var replyType dhcpv4.MessageType
	switch req.MessageType() {
	case dhcpv4.MessageTypeDiscover:
		replyType = dhcpv4.MessageTypeOffer
	case dhcpv4.MessageTypeRequest:
		replyType = dhcpv4.MessageTypeAck
	default:
		r.m.packets.WithLabelValues("ignored").Inc()
		return nil, nil
	}
	vendor := req.ClassIdentifier()
	httpBoot := strings.HasPrefix(vendor, "HTTPClient")
	if !strings.HasPrefix(vendor, "PXEClient") && !httpBoot {
		r.m.packets.WithLabelValues("ignored").Inc()
		return nil, nil
	}
	epoch, ok := r.gate()
	if !ok {
		r.m.packets.WithLabelValues("standby").Inc()
		return nil, nil
	}
	info := &Request{MAC: append(net.HardwareAddr(nil), req.ClientHWAddr...), VendorClass: vendor,
		MessageType: req.MessageType().String(), BootEpoch: epoch, UUID: req.GetOneOption(dhcpv4.OptionClientMachineIdentifier)}
	if gi := req.GatewayIPAddr; gi != nil && !gi.IsUnspecified() {
		info.RelayAgentIP = gi
	}
	arch := iana.INTEL_X86PC // PXE requires option 93; a client without it is treated as BIOS
	if archs := req.ClientArch(); len(archs) > 0 {
		arch = archs[0]
		info.Arch = arch.String()
	}
	for _, uc := range req.UserClass() {
		if uc == "iPXE" {
			info.IPXE = true
		}
	}
	bootFile, vendorReply := "", "PXEClient"
	switch {
	case info.IPXE:
		// iPXE itself, whatever it runs on: its script.
		bootFile = ScriptURL(r.cfg.ScriptBaseURL, info.MAC)
	case httpBoot:
		// UEFI HTTP boot (UEFI 2.5+, vendor class HTTPClient): the iPXE
		// binary's URL, and the vendor class echoed, or the firmware
		// ignores the offer. Only x86-64 UEFI HTTP clients have a binary.
		if arch != archX64HTTP {
			return r.unknownArch(req, arch, vendor)
		}
		bootFile, vendorReply = BootFileURL(r.cfg.ScriptBaseURL, r.cfg.BootFileEFI), "HTTPClient"
	case arch == iana.INTEL_X86PC:
		bootFile = r.cfg.BootFileBIOS
	case arch == iana.EFI_X86_64 || arch == iana.EFI_BC:
		bootFile = r.cfg.BootFileEFI
	default:
		return r.unknownArch(req, arch, vendor)
	}
	mods := []dhcpv4.Modifier{
		dhcpv4.WithMessageType(replyType),
		dhcpv4.WithServerIP(r.cfg.ServerIP),
		dhcpv4.WithOption(dhcpv4.OptServerIdentifier(r.cfg.ServerIP)),
		dhcpv4.WithOption(dhcpv4.OptClassIdentifier(vendorReply)),
		dhcpv4.WithOption(dhcpv4.OptTFTPServerName(r.cfg.TFTPServer)),
		dhcpv4.WithOption(dhcpv4.OptBootFileName(bootFile)),
		// PXE vendor options: PXE_DISCOVERY_CONTROL (6) = 8: boot the
		// file named here, no boot server discovery.
		dhcpv4.WithOption(dhcpv4.OptGeneric(dhcpv4.OptionVendorSpecificInformation, []byte{6, 1, 8, 255})),
	}
	if len(info.UUID) > 0 {
		mods = append(mods, dhcpv4.WithOption(dhcpv4.OptGeneric(dhcpv4.OptionClientMachineIdentifier, info.UUID)))
	}
	reply, err := dhcpv4.NewReplyFromRequest(req, mods...)
	if err != nil {
		r.m.packets.WithLabelValues("malformed").Inc()
		return nil, nil
	}
	if len(bootFile) < 128 {
		reply.BootFileName = bootFile
	}
	r.m.packets.WithLabelValues("answered").Inc()
	r.log.Info("PXE request answered", "mac", info.MAC.String(), "message", info.MessageType, "arch", uint16(arch),
		"vendor_class", clipVendor(vendor), "ipxe", info.IPXE, "boot_file", bootFile, "epoch", epoch)
	if r.onBoot != nil {
		r.onBoot(*info)
	}
	return reply, info
}

// archX64HTTP is client architecture 16, x64 UEFI HTTP boot (IANA
// "Processor Architecture Types"; the dhcp library names only 0-11).
const archX64HTTP iana.Arch = 16

// unknownArch logs and drops a request from a client architecture that has
// no boot file here.
func (r *Responder) unknownArch(req *dhcpv4.DHCPv4, arch iana.Arch, vendor string) (*dhcpv4.DHCPv4, *Request) {
	r.m.packets.WithLabelValues("unknown_arch").Inc()
	r.log.Warn("PXE request dropped: no boot file for this client architecture", "mac", req.ClientHWAddr.String(),
		"arch", uint16(arch), "arch_name", arch.String(), "vendor_class", clipVendor(vendor))
	return nil, nil
}

func clipVendor(s string) string {
	s = strings.ToValidUTF8(s, "?")
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}

// BootFileURL is where the boot HTTP server serves a file of the TFTP root
// (UEFI HTTP boot).
func BootFileURL(base, name string) string {
	return strings.TrimRight(base, "/") + "/tftp/" + name
}

// ScriptURL is the iPXE script URL of mac under base.
func ScriptURL(base string, mac net.HardwareAddr) string {
	return strings.TrimRight(base, "/") + "/boot/" + strings.ReplaceAll(mac.String(), ":", "-") + ".ipxe"
}
