package tlstest_test

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"testing"

	"github.com/leasehold/leasehold/pkg/leakcheck"
	"github.com/leasehold/leasehold/pkg/tlstest"
)

// envDial makes the test binary a TLS client process: "addr,n,dir" dials
// addr n times with the CA and client key pair in dir, writes 5 bytes on
// each connection and keeps them open until stdin closes.
const envDial = "LEASEHOLD_TLSTEST_DIAL"

func TestMain(m *testing.M) {
	if spec := os.Getenv(envDial); spec != "" {
		os.Exit(dialMany(spec))
	}
	leakcheck.Main(m)
}

func dialMany(spec string) int {
	var addr, dir string
	var n int
	if _, err := fmt.Sscanf(spec, "%s %d %s", &addr, &n, &dir); err != nil {
		fmt.Fprintln(os.Stderr, "bad", envDial, err)
		return 2
	}
	caPEM, err := os.ReadFile(filepath.Join(dir, "ca.pem"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	cfg := &tls.Config{ServerName: "localhost", NextProtos: []string{"h2"}}
	cfg.RootCAs = x509Pool(caPEM)
	if pair, err := tls.LoadX509KeyPair(filepath.Join(dir, "client.pem"), filepath.Join(dir, "client.key")); err == nil {
		cfg.Certificates = []tls.Certificate{pair}
	}
	conns := make([]net.Conn, 0, n)
	for range n {
		c, err := tls.Dial("tcp", addr, cfg)
		if err != nil {
			fmt.Fprintln(os.Stderr, "dial:", err)
			return 1
		}
		if _, err := c.Write([]byte("hello")); err != nil {
			fmt.Fprintln(os.Stderr, "write:", err)
			return 1
		}
		conns = append(conns, c)
	}
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin)
	for _, c := range conns {
		_ = c.Close()
	}
	return 0
}

func x509Pool(caPEM []byte) *x509.CertPool {
	p := x509.NewCertPool()
	p.AppendCertsFromPEM(caPEM)
	return p
}

// BenchmarkServerConnMemory measures what crypto/tls keeps per idle server
// connection after the handshake and one small record, with and without a
// verified client certificate: the floor under a TLS gateway session (see
// docs/gateway.md). Clients run in a child process so only the server side
// is counted; the figure includes the net.TCPConn under the tls.Conn.
func BenchmarkServerConnMemory(b *testing.B) {
	for _, mtls := range []bool{false, true} {
		b.Run("mtls="+strconv.FormatBool(mtls), func(b *testing.B) {
			const n = 1000
			ca := tlstest.NewCA(b)
			dir := b.TempDir()
			copyFile(b, ca.WriteCA(b), filepath.Join(dir, "ca.pem"))
			cfg := &tls.Config{Certificates: []tls.Certificate{ca.Server(b)}, NextProtos: []string{"h2"}, MinVersion: tls.VersionTLS12}
			if mtls {
				cert, key := tlstest.WriteKeyPair(b, ca.Client(b, "", "leasehold://node/n1"))
				copyFile(b, cert, filepath.Join(dir, "client.pem"))
				copyFile(b, key, filepath.Join(dir, "client.key"))
				cfg.ClientCAs, cfg.ClientAuth = ca.Pool(), tls.RequireAndVerifyClientCert
			}
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			defer ln.Close()
			kept := make([]*tls.Conn, 0, n)
			before, _ := heapAndStack()
			cmd := exec.Command(os.Args[0], "-test.run=^$", "-test.bench=^$")
			cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s %d %s", envDial, ln.Addr(), n, dir))
			stdin, _ := cmd.StdinPipe()
			stdout, _ := cmd.StdoutPipe()
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				b.Fatal(err)
			}
			defer func() { _ = stdin.Close(); _ = cmd.Wait() }()
			buf := make([]byte, 5)
			for range n {
				c, err := ln.Accept()
				if err != nil {
					b.Fatal(err)
				}
				tc := tls.Server(c, cfg)
				if _, err := io.ReadFull(tc, buf); err != nil {
					b.Fatal(err)
				}
				kept = append(kept, tc)
			}
			if line, err := bufio.NewReader(stdout).ReadString('\n'); err != nil || line != "ready\n" {
				b.Fatalf("client process: %q %v", line, err)
			}
			after, _ := heapAndStack()
			b.ReportMetric(float64(after-before)/n, "B/conn")
			runtime.KeepAlive(kept)
			for _, c := range kept {
				_ = c.Close()
			}
		})
	}
}

func heapAndStack() (int64, int64) {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapInuse), int64(m.StackInuse)
}

func copyFile(b *testing.B, from, to string) {
	data, err := os.ReadFile(from)
	if err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(to, data, 0o600); err != nil {
		b.Fatal(err)
	}
}
