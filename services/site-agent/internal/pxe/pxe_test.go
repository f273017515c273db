package pxe

import (
	"context"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/insomniacslk/dhcp/dhcpv4/nclient4"
	"github.com/insomniacslk/dhcp/iana"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
)

var testMAC = net.HardwareAddr{0x52, 0x54, 0x00, 0x12, 0x34, 0x56}

func testConfig() Config {
	return Config{ListenAddr: "127.0.0.1:0", PXEListenAddr: "127.0.0.1:0", ServerIP: net.IPv4(127, 0, 0, 1).To4(), BootFileBIOS: "undionly.kpxe",
		BootFileEFI: "ipxe.efi", ScriptBaseURL: "http://127.0.0.1:8080"}
}

type gate struct{ on atomic.Bool }

func (g *gate) fn() (uint64, bool) { return 7, g.on.Load() }

// startResponder listens on a free loopback port.
func startResponder(t *testing.T, g *gate, onBoot func(Request)) *Responder {
	t.Helper()
	r := New(testConfig(), g.fn, onBoot, nil, nil)
	require.NoError(t, r.Listen())
	go func() { _ = r.Serve() }()
	t.Cleanup(func() { _ = r.Close() })
	return r
}

// newClient is the dhcp library's client on a loopback UDP socket.
func newClient(t *testing.T, server *net.UDPAddr) *nclient4.Client {
	t.Helper()
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	c, err := nclient4.NewWithConn(conn, testMAC, nclient4.WithServerAddr(server), nclient4.WithTimeout(300*time.Millisecond), nclient4.WithRetry(1))
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func TestAnswersPXEDiscoverAndRequestOnlyWhileGated(t *testing.T) {
	t.Parallel()
	g := &gate{}
	var booted atomic.Int32
	r := startResponder(t, g, func(req Request) {
		require.Equal(t, testMAC.String(), req.MAC.String())
		require.EqualValues(t, 7, req.BootEpoch)
		booted.Add(1)
	})
	c := newClient(t, r.Addr())
	ctx := context.Background()
	pxeMods := []dhcpv4.Modifier{dhcpv4.WithOption(dhcpv4.OptClassIdentifier("PXEClient:Arch:00007:UNDI:003016")),
		dhcpv4.WithOption(dhcpv4.OptClientArch(iana.EFI_X86_64))}

	_, err := c.DiscoverOffer(ctx, pxeMods...)
	require.ErrorIs(t, err, nclient4.ErrNoResponse, "a standby answers nothing")

	g.on.Store(true)
	offer, err := c.DiscoverOffer(ctx, pxeMods...)
	require.NoError(t, err)
	require.Equal(t, dhcpv4.MessageTypeOffer, offer.MessageType())
	require.Equal(t, "PXEClient", offer.ClassIdentifier())
	require.Equal(t, "ipxe.efi", offer.BootFileNameOption())
	require.Equal(t, "ipxe.efi", offer.BootFileName)
	require.Equal(t, "127.0.0.1", offer.TFTPServerName())
	require.True(t, offer.ServerIPAddr.Equal(net.IPv4(127, 0, 0, 1)))
	require.True(t, offer.YourIPAddr.IsUnspecified(), "a proxy hands out no address")
	require.True(t, offer.ServerIdentifier().Equal(net.IPv4(127, 0, 0, 1)))

	// iPXE asks again: it gets its script's URL.
	req, err := dhcpv4.NewRequestFromOffer(offer, append(pxeMods, dhcpv4.WithUserClass("iPXE", false))...)
	require.NoError(t, err)
	ack, err := c.SendAndRead(ctx, r.Addr(), req, nclient4.IsMessageType(dhcpv4.MessageTypeAck))
	require.NoError(t, err)
	require.Equal(t, "http://127.0.0.1:8080/boot/52-54-00-12-34-56.ipxe", ack.BootFileNameOption())
	require.EqualValues(t, 2, booted.Load())

	// The ProxyDHCP REQUEST iPXE sends to the boot server port (4011) is
	// acknowledged there.
	require.NotNil(t, r.PXEAddr())
	ack, err = c.SendAndRead(ctx, r.PXEAddr(), req, nclient4.IsMessageType(dhcpv4.MessageTypeAck))
	require.NoError(t, err)
	require.Equal(t, "http://127.0.0.1:8080/boot/52-54-00-12-34-56.ipxe", ack.BootFileNameOption())

	// Not a PXE client: a proxy stays silent.
	_, err = c.DiscoverOffer(ctx, dhcpv4.WithOption(dhcpv4.OptClassIdentifier("MSFT 5.0")))
	require.ErrorIs(t, err, nclient4.ErrNoResponse)
}

func TestUEFIHTTPBootGetsTheBinarysURLAndTheVendorClassEchoed(t *testing.T) {
	t.Parallel()
	g := &gate{}
	g.on.Store(true)
	r := New(testConfig(), g.fn, nil, nil, nil)
	d, err := dhcpv4.NewDiscovery(testMAC, dhcpv4.WithOption(dhcpv4.OptClassIdentifier("HTTPClient:Arch:00016:UNDI:003001")),
		dhcpv4.WithOption(dhcpv4.OptClientArch(iana.Arch(16))))
	require.NoError(t, err)
	offer, err := dhcpv4.FromBytes(r.HandlePacket(d.ToBytes()))
	require.NoError(t, err)
	require.Equal(t, "HTTPClient", offer.ClassIdentifier())
	require.Equal(t, "http://127.0.0.1:8080/tftp/ipxe.efi", offer.BootFileNameOption())
	require.Equal(t, "http://127.0.0.1:8080/tftp/ipxe.efi", offer.BootFileName)

	// A BIOS client and a UEFI x64 PXE client get their TFTP file names.
	for arch, want := range map[iana.Arch]string{iana.INTEL_X86PC: "undionly.kpxe", iana.EFI_BC: "ipxe.efi", iana.EFI_X86_64: "ipxe.efi"} {
		d, err := dhcpv4.NewDiscovery(testMAC, dhcpv4.WithOption(dhcpv4.OptClassIdentifier("PXEClient")), dhcpv4.WithOption(dhcpv4.OptClientArch(arch)))
		require.NoError(t, err)
		offer, err := dhcpv4.FromBytes(r.HandlePacket(d.ToBytes()))
		require.NoError(t, err, arch.String())
		require.Equal(t, want, offer.BootFileNameOption(), arch.String())
		require.Equal(t, "PXEClient", offer.ClassIdentifier())
	}
}

func TestUnknownClientArchitectureIsDroppedWithALogLine(t *testing.T) {
	t.Parallel()
	g := &gate{}
	g.on.Store(true)
	var logs strings.Builder
	r := New(testConfig(), g.fn, nil, slog.New(slog.NewTextHandler(&logs, nil)), nil)
	for _, tc := range []struct {
		vendor string
		arch   iana.Arch
	}{{"PXEClient:Arch:00011", iana.EFI_ARM64}, {"PXEClient:Arch:00006", iana.EFI_IA32}, {"HTTPClient:Arch:00019", iana.Arch(19)},
		{"PXEClient", iana.Arch(4242)}} {
		d, err := dhcpv4.NewDiscovery(testMAC, dhcpv4.WithOption(dhcpv4.OptClassIdentifier(tc.vendor)), dhcpv4.WithOption(dhcpv4.OptClientArch(tc.arch)))
		require.NoError(t, err)
		require.Nil(t, r.HandlePacket(d.ToBytes()), tc.vendor)
	}
	require.Equal(t, 4.0, testutil.ToFloat64(r.m.packets.WithLabelValues("unknown_arch")))
	require.Contains(t, logs.String(), "no boot file for this client architecture")
	require.Contains(t, logs.String(), "arch=4242")
	// iPXE on any architecture still gets its script.
	d, err := dhcpv4.NewDiscovery(testMAC, dhcpv4.WithOption(dhcpv4.OptClassIdentifier("PXEClient")),
		dhcpv4.WithOption(dhcpv4.OptClientArch(iana.EFI_ARM64)), dhcpv4.WithUserClass("iPXE", false))
	require.NoError(t, err)
	require.NotNil(t, r.HandlePacket(d.ToBytes()))
}

func TestMalformedPacketsAndMACsAreIgnored(t *testing.T) {
	t.Parallel()
	g := &gate{}
	g.on.Store(true)
	var logs strings.Builder
	r := New(testConfig(), g.fn, nil, slog.New(slog.NewTextHandler(&logs, nil)), nil)
	good, err := dhcpv4.NewDiscovery(testMAC, dhcpv4.WithOption(dhcpv4.OptClassIdentifier("PXEClient")))
	require.NoError(t, err)
	require.NotNil(t, r.HandlePacket(good.ToBytes()))

	for name, mutate := range map[string]func(d *dhcpv4.DHCPv4){
		"multicast MAC":  func(d *dhcpv4.DHCPv4) { d.ClientHWAddr = net.HardwareAddr{1, 0, 0x5e, 0, 0, 1} },
		"zero MAC":       func(d *dhcpv4.DHCPv4) { d.ClientHWAddr = make(net.HardwareAddr, 6) },
		"short MAC":      func(d *dhcpv4.DHCPv4) { d.ClientHWAddr = net.HardwareAddr{1, 2, 3} },
		"long MAC":       func(d *dhcpv4.DHCPv4) { d.ClientHWAddr = make(net.HardwareAddr, 16) },
		"not ethernet":   func(d *dhcpv4.DHCPv4) { d.HWType = iana.HWTypeIEEE802 },
		"a reply":        func(d *dhcpv4.DHCPv4) { d.OpCode = dhcpv4.OpcodeBootReply },
		"release":        func(d *dhcpv4.DHCPv4) { d.UpdateOption(dhcpv4.OptMessageType(dhcpv4.MessageTypeRelease)) },
		"no vendor":      func(d *dhcpv4.DHCPv4) { d.DeleteOption(dhcpv4.OptionClassIdentifier) },
		"no message typ": func(d *dhcpv4.DHCPv4) { d.DeleteOption(dhcpv4.OptionDHCPMessageType) },
	} {
		d, err := dhcpv4.FromBytes(good.ToBytes())
		require.NoError(t, err)
		mutate(d)
		require.Nil(t, r.HandlePacket(d.ToBytes()), name)
	}
	raw := good.ToBytes()
	for _, b := range [][]byte{nil, {1}, raw[:100], raw[:239], append(append([]byte{}, raw[:240]...), 53, 200)} {
		require.Nil(t, r.HandlePacket(b))
	}
	hw := good.ToBytes()
	hw[2] = 200 // hardware address length beyond 16
	require.Nil(t, r.HandlePacket(hw))
	require.Contains(t, logs.String(), "DHCP packet dropped: does not parse")
	require.Contains(t, logs.String(), "DHCP packet dropped: not an Ethernet BOOTREQUEST")
	require.NotNil(t, r.HandlePacket(good.ToBytes()), "still serving")
}

func TestParseMACRefusesMalformed(t *testing.T) {
	t.Parallel()
	mac, err := ParseMAC("52-54-00-12-34-56")
	require.NoError(t, err)
	require.Equal(t, testMAC.String(), mac.String())
	for _, s := range []string{"", "52:54:00:12:34", "01:00:5e:00:00:01", "00:00:00:00:00:00", "zz:54:00:12:34:56",
		"5254.0012.3456", "52:54:00:12:34:56:78:9a", strings.Repeat("a", 1000)} {
		_, err := ParseMAC(s)
		require.Error(t, err, s)
	}
}

func TestScriptChainsKernelAndInitrdFromTheCache(t *testing.T) {
	t.Parallel()
	k, i := strings.Repeat("a", 64), strings.Repeat("b", 64)
	p := Profile{Kernel: k, Initrd: i, Cmdline: "console=ttyS0 ip=dhcp"}
	require.NoError(t, p.Validate())
	require.Equal(t, "#!ipxe\nkernel http://10.0.0.2:8080/images/sha256/"+k+" console=ttyS0 ip=dhcp\ninitrd http://10.0.0.2:8080/images/sha256/"+i+"\nboot\n",
		Script("http://10.0.0.2:8080/", p))
	require.Error(t, Profile{Kernel: k, Initrd: i, Cmdline: "x\nshell"}.Validate(), "no command injection through the cmdline")
	require.Error(t, Profile{Kernel: "../etc", Initrd: i}.Validate())

	h := NewHosts()
	require.NoError(t, h.Load(HostsFile{Hosts: map[string]Profile{"52:54:00:12:34:56": p}}))
	require.True(t, h.Known(testMAC))
	require.False(t, h.Known(net.HardwareAddr{2, 0, 0, 0, 0, 1}))
	require.Error(t, h.Load(HostsFile{Hosts: map[string]Profile{"not-a-mac": p}}))
}

// FuzzHandlePacket feeds arbitrary bytes to the packet handler: it must
// never panic, and whatever it answers must be a well-formed BOOTREPLY for a
// valid unicast MAC. Seeds live in testdata/fuzz/FuzzHandlePacket.
func FuzzHandlePacket(f *testing.F) {
	good, _ := dhcpv4.NewDiscovery(testMAC, dhcpv4.WithOption(dhcpv4.OptClassIdentifier("PXEClient")),
		dhcpv4.WithUserClass("iPXE", false), dhcpv4.WithOption(dhcpv4.OptClientArch(iana.EFI_ARM64)))
	f.Add(good.ToBytes())
	f.Add([]byte{})
	g := &gate{}
	g.on.Store(true)
	r := New(testConfig(), g.fn, func(Request) {}, nil, nil)
	f.Fuzz(func(t *testing.T, b []byte) {
		out := r.HandlePacket(b)
		if out == nil {
			return
		}
		reply, err := dhcpv4.FromBytes(out)
		if err != nil {
			t.Fatalf("reply does not parse: %v", err)
		}
		if reply.OpCode != dhcpv4.OpcodeBootReply || !ValidMAC(reply.ClientHWAddr) {
			t.Fatalf("bad reply %v", reply.Summary())
		}
	})
}
