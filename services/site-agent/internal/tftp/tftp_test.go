package tftp

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
)

type bundle struct {
	srv    *Server
	root   string
	open   atomic.Bool
	logsFn func() string
}

func setup(t *testing.T, mutate func(*Config)) *bundle {
	t.Helper()
	b := &bundle{root: t.TempDir()}
	b.open.Store(true)
	cfg := Config{ListenAddr: "127.0.0.1:0", Root: b.root, MaxTransfers: 8, MaxBlockSize: 1468,
		Timeout: 200 * time.Millisecond, Retries: 3}
	if mutate != nil {
		mutate(&cfg)
	}
	require.NoError(t, cfg.Validate())
	logs := &syncWriter{}
	b.srv = New(cfg, func() (uint64, bool) { return 7, b.open.Load() }, slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})), prometheus.NewRegistry())
	require.NoError(t, b.srv.Listen())
	done := make(chan error, 1)
	go func() { done <- b.srv.Serve() }()
	t.Cleanup(func() {
		require.NoError(t, b.srv.Close())
		require.NoError(t, <-done)
		if t.Failed() {
			t.Logf("server log:\n%s", logs.String())
		}
	})
	b.logsFn = logs.String
	return b
}

// syncWriter collects the server's log for assertions.
type syncWriter struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (w *syncWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.Write(p)
}

func (w *syncWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}

// client is a minimal TFTP client written for these tests.
type client struct {
	t    *testing.T
	conn *net.UDPConn
	srv  *net.UDPAddr
	peer *net.UDPAddr // the transfer port, once known
}

func (b *bundle) client(t *testing.T) *client {
	t.Helper()
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return &client{t: t, conn: conn, srv: b.srv.Addr()}
}

func rrq(op uint16, name, mode string, opts ...string) []byte {
	p := binary.BigEndian.AppendUint16(nil, op)
	for _, s := range append([]string{name, mode}, opts...) {
		p = append(p, s...)
		p = append(p, 0)
	}
	return p
}

func (c *client) send(p []byte) {
	_, err := c.conn.WriteToUDP(p, c.srv)
	require.NoError(c.t, err)
}

func (c *client) ack(block uint16) {
	p := binary.BigEndian.AppendUint16(nil, opACK)
	p = binary.BigEndian.AppendUint16(p, block)
	_, err := c.conn.WriteToUDP(p, c.peer)
	require.NoError(c.t, err)
}

// recv returns the next packet, or nil after wait.
func (c *client) recv(wait time.Duration) []byte {
	buf := make([]byte, 70000)
	_ = c.conn.SetReadDeadline(time.Now().Add(wait))
	n, from, err := c.conn.ReadFromUDP(buf)
	if err != nil {
		return nil
	}
	c.peer = from
	return buf[:n]
}

func op(p []byte) uint16 { return binary.BigEndian.Uint16(p) }

func errMsg(p []byte) (uint16, string) {
	return binary.BigEndian.Uint16(p[2:]), strings.TrimRight(string(p[4:]), "\x00")
}

// get reads name with opts and returns the file and the OACK options.
func (c *client) get(name string, opts ...string) ([]byte, map[string]string) {
	c.t.Helper()
	c.send(rrq(opRRQ, name, "octet", opts...))
	var (
		out  []byte
		oack map[string]string
		want = uint16(1)
	)
	blk := 512
	for {
		p := c.recv(5 * time.Second)
		require.NotNil(c.t, p, "no packet from the server")
		switch op(p) {
		case opOACK:
			oack = map[string]string{}
			f := bytes.Split(bytes.TrimSuffix(p[2:], []byte{0}), []byte{0})
			for i := 0; i+1 < len(f); i += 2 {
				oack[string(f[i])] = string(f[i+1])
			}
			if v, ok := oack["blksize"]; ok {
				n, _ := optionInt(v)
				blk = n
			}
			c.ack(0)
		case opDATA:
			block := binary.BigEndian.Uint16(p[2:])
			if block == want {
				out = append(out, p[4:]...)
				want++
			}
			c.ack(block)
			if block == want-1 && len(p)-4 < blk {
				return out, oack
			}
		case opERROR:
			code, msg := errMsg(p)
			c.t.Fatalf("server error %d: %s", code, msg)
		}
	}
}

func (b *bundle) file(t *testing.T, name string, size int) []byte {
	t.Helper()
	data := make([]byte, size)
	_, _ = rand.Read(data)
	require.NoError(t, os.MkdirAll(filepath.Dir(filepath.Join(b.root, name)), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(b.root, name), data, 0o644))
	return data
}

func TestReadsFilesWithAndWithoutOptions(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	small := b.file(t, "undionly.kpxe", 1300)
	exact := b.file(t, "sub/exact.bin", 1024) // a multiple of 512: ends with an empty block
	big := b.file(t, "ipxe.efi", 200_000)

	c := b.client(t)
	got, oack := c.get("undionly.kpxe")
	require.Equal(t, small, got)
	require.Nil(t, oack, "no options asked, no OACK")
	require.NotEqual(t, b.srv.Addr().Port, c.peer.Port, "the transfer runs on its own port")

	got, _ = b.client(t).get("sub/exact.bin")
	require.Equal(t, exact, got)

	got, oack = b.client(t).get("ipxe.efi", "blksize", "1024", "tsize", "0", "timeout", "3")
	require.Equal(t, big, got)
	require.Equal(t, map[string]string{"blksize": "1024", "tsize": "200000", "timeout": "3"}, oack)

	got, oack = b.client(t).get("ipxe.efi", "BLKSIZE", "9000", "windowsize", "8")
	require.Equal(t, big, got)
	require.Equal(t, map[string]string{"blksize": "1468"}, oack, "blksize capped, unknown options left out")

	require.Eventually(t, func() bool { return testutil.ToFloat64(b.srv.m.transfers.WithLabelValues("completed")) == 4 },
		5*time.Second, 10*time.Millisecond)
}

// UEFI firmware asks for tsize alone, then aborts after the OACK and asks
// again for the file.
func TestTsizeQueryThenAbort(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	data := b.file(t, "ipxe.efi", 5000)
	c := b.client(t)
	c.send(rrq(opRRQ, "ipxe.efi", "octet", "tsize", "0"))
	p := c.recv(5 * time.Second)
	require.NotNil(t, p)
	require.Equal(t, opOACK, op(p))
	require.Contains(t, string(p), "tsize\x005000\x00")
	_, err := c.conn.WriteToUDP(errorPacket(errOptionRefused, "abort after tsize"), c.peer)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return testutil.ToFloat64(b.srv.m.transfers.WithLabelValues("aborted")) == 1 },
		5*time.Second, 10*time.Millisecond)
	got, _ := b.client(t).get("ipxe.efi", "blksize", "1468")
	require.Equal(t, data, got)
}

func TestRetransmitsAnUnacknowledgedBlock(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	data := b.file(t, "f", 700)
	c := b.client(t)
	c.send(rrq(opRRQ, "f", "octet"))
	first := c.recv(5 * time.Second)
	require.Equal(t, opDATA, op(first))
	again := c.recv(5 * time.Second) // not acknowledged: sent again after the timeout
	require.Equal(t, first, again)
	c.ack(1)
	last := c.recv(5 * time.Second)
	require.Equal(t, data[512:], last[4:])
	c.ack(1) // a duplicate ACK of block 1 does not make the server resend block 2
	c.ack(2)
	require.Eventually(t, func() bool { return testutil.ToFloat64(b.srv.m.transfers.WithLabelValues("completed")) == 1 },
		5*time.Second, 10*time.Millisecond)
}

func TestRefusesWritesAndEscapes(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.file(t, "ok.bin", 10)
	outside := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(outside, "secret"), []byte("secret"), 0o644))
	require.NoError(t, os.Symlink(filepath.Join(outside, "secret"), filepath.Join(b.root, "escape")))
	require.NoError(t, os.Symlink("../", filepath.Join(b.root, "up")))
	require.NoError(t, os.Symlink("ok.bin", filepath.Join(b.root, "inside"))) // stays in the root: allowed
	require.NoError(t, os.Mkdir(filepath.Join(b.root, "dir"), 0o755))

	cases := []struct {
		name string
		pkt  []byte
		code uint16
		msg  string
	}{
		{"write", rrq(opWRQ, "new.bin", "octet"), errAccess, "read-only"},
		{"dotdot", rrq(opRRQ, "../secret", "octet"), errAccess, "outside the TFTP root"},
		{"absolute", rrq(opRRQ, "/etc/passwd", "octet"), errAccess, "absolute"},
		{"backslash", rrq(opRRQ, `..\secret`, "octet"), errAccess, "backslash"},
		{"symlink out of the root", rrq(opRRQ, "escape", "octet"), errAccess, "outside the TFTP root"},
		{"symlinked dir out of the root", rrq(opRRQ, "up/"+filepath.Base(outside)+"/secret", "octet"), errAccess, "outside the TFTP root"},
		{"missing", rrq(opRRQ, "nope.efi", "octet"), errFileNotFound, "file not found"},
		{"directory", rrq(opRRQ, "dir", "octet"), errFileNotFound, "not a regular file"},
		{"netascii", rrq(opRRQ, "ok.bin", "netascii"), errIllegalOp, "octet"},
	}
	for _, tc := range cases {
		c := b.client(t)
		c.send(tc.pkt)
		p := c.recv(5 * time.Second)
		require.NotNil(t, p, tc.name)
		require.Equal(t, opERROR, op(p), tc.name)
		code, msg := errMsg(p)
		require.Equal(t, tc.code, code, tc.name)
		require.Contains(t, msg, tc.msg, tc.name)
		require.NotContains(t, msg, b.root, "the root's path is not told to clients")
	}
	_, err := os.Stat(filepath.Join(b.root, "new.bin"))
	require.ErrorIs(t, err, os.ErrNotExist, "nothing written")
	got, _ := b.client(t).get("inside")
	require.Len(t, got, 10)
	require.Contains(t, b.logsFn(), "TFTP write refused")
	require.Contains(t, b.logsFn(), "path outside the TFTP root")
}

func TestDropsMalformedAndOversizedRequestsAndKeepsServing(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	data := b.file(t, "f", 100)
	long := rrq(opRRQ, strings.Repeat("a", 600), "octet")
	for _, p := range [][]byte{long, {0, 1}, {0, 9, 'x', 0}, []byte("\x00\x01f\x00octet"), rrq(opRRQ, "f", "octet", "blksize"),
		rrq(opRRQ, "f", "octet", "tsize", "0", "TSIZE", "0"), {0, 4, 0, 1}} {
		c := b.client(t)
		c.send(p)
		require.Nil(t, c.recv(300*time.Millisecond), "no answer to %q", p)
	}
	require.Equal(t, 7.0, testutil.ToFloat64(b.srv.m.requests.WithLabelValues("malformed")))
	require.Contains(t, b.logsFn(), "larger than 512 bytes")
	got, _ := b.client(t).get("f")
	require.Equal(t, data, got)
}

func TestStandbyNeverAnswersAndAFencedTransferStops(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.file(t, "f", 5000)
	b.open.Store(false)
	c := b.client(t)
	c.send(rrq(opRRQ, "f", "octet"))
	require.Nil(t, c.recv(300*time.Millisecond), "a standby does not answer")
	require.Equal(t, 1.0, testutil.ToFloat64(b.srv.m.requests.WithLabelValues("standby")))

	b.open.Store(true)
	c.send(rrq(opRRQ, "f", "octet"))
	p := c.recv(5 * time.Second)
	require.Equal(t, opDATA, op(p))
	b.open.Store(false) // the grant lapses mid-transfer
	c.ack(1)
	p = c.recv(5 * time.Second)
	require.NotNil(t, p)
	require.Equal(t, opERROR, op(p))
	_, msg := errMsg(p)
	require.Contains(t, msg, "no longer active")
	require.Eventually(t, func() bool { return testutil.ToFloat64(b.srv.m.transfers.WithLabelValues("fenced")) == 1 },
		5*time.Second, 10*time.Millisecond)
}

func TestBoundsConcurrentTransfers(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *Config) { c.MaxTransfers = 1; c.Timeout = 2 * time.Second })
	b.file(t, "f", 5000)
	hold := b.client(t)
	hold.send(rrq(opRRQ, "f", "octet"))
	require.Equal(t, opDATA, op(hold.recv(5*time.Second))) // not acknowledged: the slot stays taken
	c := b.client(t)
	c.send(rrq(opRRQ, "f", "octet"))
	p := c.recv(5 * time.Second)
	require.NotNil(t, p)
	require.Equal(t, opERROR, op(p))
	_, msg := errMsg(p)
	require.Contains(t, msg, "server busy")
	require.Equal(t, 1.0, testutil.ToFloat64(b.srv.m.requests.WithLabelValues("busy")))
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	err := Config{ListenAddr: "nope", MaxBlockSize: 100, Timeout: time.Millisecond}.Validate()
	require.Error(t, err)
	for _, s := range []string{"--tftp.listen-addr", "--tftp.root", "--tftp.max-transfers", "--tftp.max-blksize", "--tftp.timeout", "--tftp.retries"} {
		require.ErrorContains(t, err, s)
	}
}
