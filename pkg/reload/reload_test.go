package reload_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/jonboulle/clockwork"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/reload"
	"github.com/leasehold/leasehold/pkg/tlstest"
)

// install writes c over certFile and keyFile the way a Secret update does:
// each file renamed into place, so a reader sees old or new, never half.
func install(t *testing.T, c tls.Certificate, certFile, keyFile string) {
	t.Helper()
	cf, kf := tlstest.WriteKeyPair(t, c)
	require.NoError(t, os.Rename(cf, certFile))
	require.NoError(t, os.Rename(kf, keyFile))
}

func installCA(t *testing.T, ca *tlstest.CA, path string) {
	t.Helper()
	require.NoError(t, os.Rename(ca.WriteCA(t), path))
}

// serve accepts TLS connections on loopback with cfg, completes each
// handshake and closes it, until the test ends.
func serve(t *testing.T, cfg *tls.Config) string {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	require.NoError(t, err)
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				if c.(*tls.Conn).Handshake() == nil {
					_, _ = c.Write([]byte("ok"))
				}
			}()
		}
	}()
	return ln.Addr().String()
}

// dial handshakes with addr trusting roots, presenting client (if any), and
// returns the serving certificate's serial, or the error of the handshake or
// of the first read (TLS 1.3 reports a refused client certificate there).
func dial(addr string, roots *x509.CertPool, client *tls.Certificate) (string, error) {
	cfg := &tls.Config{RootCAs: roots, ServerName: "localhost", MinVersion: tls.VersionTLS12}
	if client != nil {
		cfg.Certificates = []tls.Certificate{*client}
	}
	d := &net.Dialer{Timeout: 10 * time.Second}
	c, err := tls.DialWithDialer(d, "tcp", addr, cfg)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c, make([]byte, 2)); err != nil {
		return "", err
	}
	return c.ConnectionState().PeerCertificates[0].SerialNumber.String(), nil
}

func TestCertificateRotationReachesNewHandshakes(t *testing.T) {
	ca := tlstest.NewCA(t)
	first := ca.Server(t)
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	install(t, first, certFile, keyFile)
	reg := prometheus.NewRegistry()
	tl, err := reload.NewTLS("gateway", reload.TLSFiles{Cert: certFile, Key: keyFile}, nil, reload.Options{Registerer: reg})
	require.NoError(t, err)
	addr := serve(t, tl.ServerConfig())

	serial, err := dial(addr, ca.Pool(), nil)
	require.NoError(t, err)
	require.Equal(t, first.Leaf.SerialNumber.String(), serial)
	require.ErrorIs(t, tl.Check(), reload.ErrUnchanged)

	second := ca.Server(t)
	install(t, second, certFile, keyFile)
	require.NoError(t, tl.Check())
	serial, err = dial(addr, ca.Pool(), nil)
	require.NoError(t, err)
	require.Equal(t, second.Leaf.SerialNumber.String(), serial, "a new handshake serves the renewed certificate")
	require.Equal(t, float64(second.Leaf.NotAfter.Unix()),
		testutil.ToFloat64(gauge(t, reg, "leasehold_tls_certificate_expiry_timestamp_seconds")))

	// A broken renewal keeps the certificate in force and says so.
	require.NoError(t, os.WriteFile(certFile, []byte("-----BEGIN CERTIFICATE-----\nbroken\n"), 0o600))
	require.Error(t, tl.Check())
	require.Error(t, tl.Check(), "the same broken contents stay an error, not 'unchanged'")
	serial, err = dial(addr, ca.Pool(), nil)
	require.NoError(t, err)
	require.Equal(t, second.Leaf.SerialNumber.String(), serial)
	require.Equal(t, 1.0, testutil.ToFloat64(gauge(t, reg, "leasehold_config_reload_failing")))
	require.Equal(t, 2, testutil.CollectAndCount(reg, "leasehold_config_reloads_total"), "ok and error series")

	third := ca.Server(t)
	install(t, third, certFile, keyFile)
	require.NoError(t, tl.Check())
	require.Equal(t, 0.0, testutil.ToFloat64(gauge(t, reg, "leasehold_config_reload_failing")))
	require.Equal(t, third.Leaf.SerialNumber, tl.Leaf().SerialNumber)
}

// gauge finds the single series of name on reg.
func gauge(t *testing.T, reg *prometheus.Registry, name string) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			require.Len(t, mf.GetMetric(), 1, name)
			v := mf.GetMetric()[0].GetGauge().GetValue()
			return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "x"}, func() float64 { return v })
		}
	}
	t.Fatalf("no metric %s", name)
	return nil
}

func TestClientCARotation(t *testing.T) {
	serverCA, oldCA, newCA := tlstest.NewCA(t), tlstest.NewCA(t), tlstest.NewCA(t)
	dir := t.TempDir()
	certFile, keyFile, caFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"), filepath.Join(dir, "ca.crt")
	install(t, serverCA.Server(t), certFile, keyFile)
	installCA(t, oldCA, caFile)
	tl, err := reload.NewTLS("gateway", reload.TLSFiles{Cert: certFile, Key: keyFile, ClientCA: caFile},
		&tls.Config{MinVersion: tls.VersionTLS12}, reload.Options{})
	require.NoError(t, err)
	addr := serve(t, tl.ServerConfig())
	oldClient, newClient := oldCA.Client(t, "node-1"), newCA.Client(t, "node-1")

	_, err = dial(addr, serverCA.Pool(), &oldClient)
	require.NoError(t, err)
	_, err = dial(addr, serverCA.Pool(), &newClient)
	require.Error(t, err, "a client of a CA not yet installed is refused")

	installCA(t, newCA, caFile)
	require.NoError(t, tl.Check())
	_, err = dial(addr, serverCA.Pool(), &newClient)
	require.NoError(t, err, "the new CA's clients are accepted without a restart")
	_, err = dial(addr, serverCA.Pool(), &oldClient)
	require.Error(t, err, "the old CA's clients are refused once it is rotated out")

	require.NoError(t, os.WriteFile(caFile, []byte("not a certificate"), 0o600))
	require.Error(t, tl.Check())
	_, err = dial(addr, serverCA.Pool(), &newClient)
	require.NoError(t, err, "a bad CA file keeps the CA in force")
}

// TestRunPicksUpChanges is about logic, on an injected clock: Run re-reads
// the files at each tick of its interval, loads what changed, and keeps
// what was loaded when a version fails to load.
func TestRunPicksUpChanges(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tokens")
	require.NoError(t, os.WriteFile(path, []byte("one"), 0o600))
	clock := clockwork.NewFakeClock()
	type load struct {
		contents string
		at       time.Time
	}
	loads := make(chan load, 8)
	w, err := reload.NewWatcher("test", []string{path}, func(c [][]byte) error {
		loads <- load{string(c[0]), clock.Now()}
		if string(c[0]) == "bad" {
			return errors.New("bad contents")
		}
		return nil
	}, reload.Options{Clock: clock})
	require.NoError(t, err)
	require.Equal(t, "one", (<-loads).contents, "NewWatcher loads once")

	const every = 30 * time.Second
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); w.Run(ctx, every) }()
	t.Cleanup(func() { cancel(); <-done })
	bctx, bcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer bcancel()
	require.NoError(t, clock.BlockUntilContext(bctx, 1), "Run's ticker")
	start := clock.Now()

	next := func(what string) load {
		t.Helper()
		select {
		case l := <-loads:
			return l
		case <-time.After(10 * time.Second):
			t.Fatalf("no load of %s", what)
			panic("unreachable")
		}
	}
	// Replace the file whole, as a Secret or cert-manager does.
	replace := func(contents string) {
		tmp := path + ".tmp"
		require.NoError(t, os.WriteFile(tmp, []byte(contents), 0o600))
		require.NoError(t, os.Rename(tmp, path))
	}

	// A change waits for the next tick: a millisecond short of the interval
	// nothing is read; at the interval the new contents are tried.
	replace("bad")
	clock.Advance(every - time.Millisecond)
	clock.Advance(time.Millisecond)
	require.Equal(t, load{"bad", start.Add(every)}, next("bad"), "read at the first tick, not before")

	// The next version loads at the tick after it was written.
	replace("two")
	clock.Advance(every)
	require.Equal(t, load{"two", start.Add(2 * every)}, next("two"))
	require.Empty(t, loads, "each version was tried once")

	_, err = reload.NewWatcher("missing", []string{filepath.Join(t.TempDir(), "nope")}, func([][]byte) error { return nil }, reload.Options{})
	require.ErrorIs(t, err, os.ErrNotExist)
}
