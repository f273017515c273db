package reload_test

import (
	"crypto/tls"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/reload"
	"github.com/leasehold/leasehold/pkg/tlstest"
)

// clientDial handshakes with addr using cfg and returns the subject of the
// client certificate the server saw (empty when none), or the error of the
// handshake or of the first read.
func clientDial(addr string, cfg *tls.Config) error {
	cfg = cfg.Clone()
	cfg.ServerName = "localhost"
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 10 * time.Second}, "tcp", addr, cfg)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	_, err = io.ReadFull(c, make([]byte, 2))
	return err
}

// TestClientTLSFollowsItsFiles: a client whose CA bundle and client
// certificate are rotated on disk verifies the server against the new
// bundle and presents the new certificate on its next handshake, without a
// restart; a broken rotation keeps the previous files in force.
func TestClientTLSFollowsItsFiles(t *testing.T) {
	t.Parallel()
	serverCA, otherCA, clientCA := tlstest.NewCA(t), tlstest.NewCA(t), tlstest.NewCA(t)
	dir := t.TempDir()

	// The server requires a client certificate from clientCA.
	sCert, sKey := filepath.Join(dir, "s.crt"), filepath.Join(dir, "s.key")
	install(t, serverCA.Server(t), sCert, sKey)
	sCA := filepath.Join(dir, "client-ca.pem")
	installCA(t, clientCA, sCA)
	srv, err := reload.NewTLS("gateway", reload.TLSFiles{Cert: sCert, Key: sKey, ClientCA: sCA}, nil, reload.Options{})
	require.NoError(t, err)
	addr := serve(t, srv.ServerConfig())

	// The client trusts otherCA first (wrong) and has a certificate from
	// otherCA (refused by the server).
	caFile, cCert, cKey := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "c.crt"), filepath.Join(dir, "c.key")
	installCA(t, otherCA, caFile)
	install(t, otherCA.Client(t, "node-1"), cCert, cKey)
	cl, err := reload.NewClientTLS("node", reload.ClientTLSFiles{CA: caFile, Cert: cCert, Key: cKey}, reload.Options{})
	require.NoError(t, err)
	cfg := cl.Config()
	require.Error(t, clientDial(addr, cfg), "the server's certificate does not chain to the client's CA")

	installCA(t, serverCA, caFile)
	require.NoError(t, cl.Check())
	require.Error(t, clientDial(addr, cfg), "the server refuses the client certificate")

	good := clientCA.Client(t, "node-1")
	install(t, good, cCert, cKey)
	require.NoError(t, cl.Check())
	require.NoError(t, clientDial(addr, cfg), "the same config now verifies and is accepted")
	require.Equal(t, good.Leaf.SerialNumber, cl.Leaf().SerialNumber)

	// A key that does not match its certificate: refused, previous kept.
	install(t, clientCA.Client(t, "node-1"), cCert, filepath.Join(dir, "unused.key"))
	_, keyOnly := tlstest.WriteKeyPair(t, clientCA.Client(t, "node-2"))
	require.NoError(t, os.Rename(keyOnly, cKey))
	err = cl.Check()
	require.ErrorContains(t, err, cCert, "the error names the file")
	require.NoError(t, clientDial(addr, cfg))
	require.Equal(t, good.Leaf.SerialNumber, cl.Leaf().SerialNumber)
}

// TestClientTLSRefusesBadFiles: files that cannot serve are refused at
// start with the file's name: an empty CA bundle, a certificate without
// its key.
func TestClientTLSRefusesBadFiles(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty.pem")
	require.NoError(t, os.WriteFile(empty, []byte("not pem\n"), 0o600))
	_, err := reload.NewClientTLS("node", reload.ClientTLSFiles{CA: empty}, reload.Options{})
	require.ErrorContains(t, err, empty)
	_, err = reload.NewClientTLS("node", reload.ClientTLSFiles{Cert: empty}, reload.Options{})
	require.ErrorContains(t, err, "go together")
	none, err := reload.NewClientTLS("node", reload.ClientTLSFiles{}, reload.Options{})
	require.NoError(t, err)
	require.Nil(t, none.Leaf())
}

// TestNodeClientTLSRefusesAnotherNodesCertificate: an agent given a client
// certificate that names another node (URI SAN, else CommonName) is
// refused at start, naming the file; its own node's certificate, or one
// naming no node, is accepted.
func TestNodeClientTLSRefusesAnotherNodesCertificate(t *testing.T) {
	t.Parallel()
	ca := tlstest.NewCA(t)
	caFile := ca.WriteCA(t)
	other, otherKey := tlstest.WriteKeyPair(t, ca.Client(t, "", nodeauth.NodeURI("n-2")))
	_, err := reload.NewNodeClientTLS("node", reload.ClientTLSFiles{CA: caFile, Cert: other, Key: otherKey}, "n-1", reload.Options{})
	require.ErrorContains(t, err, other)
	require.ErrorContains(t, err, `names node "n-2", not "n-1"`)

	mine, mineKey := tlstest.WriteKeyPair(t, ca.Client(t, "", nodeauth.NodeURI("n-1")))
	_, err = reload.NewNodeClientTLS("node", reload.ClientTLSFiles{CA: caFile, Cert: mine, Key: mineKey}, "n-1", reload.Options{})
	require.NoError(t, err)
	anon, anonKey := tlstest.WriteKeyPair(t, ca.Client(t, ""))
	_, err = reload.NewNodeClientTLS("node", reload.ClientTLSFiles{CA: caFile, Cert: anon, Key: anonKey}, "n-1", reload.Options{})
	require.NoError(t, err, "a certificate that names no node")
}

// TestClientTLSFilesValidateNamesTheFlags: files with an http:// gateway,
// or a certificate without its key, are refused naming the flags.
func TestClientTLSFilesValidateNamesTheFlags(t *testing.T) {
	t.Parallel()
	require.NoError(t, reload.ClientTLSFiles{}.Validate("", "http://gw:9443"))
	require.NoError(t, reload.ClientTLSFiles{CA: "/ca.pem"}.Validate("", "https://gw:9443"))
	err := reload.ClientTLSFiles{CA: "/ca.pem", Cert: "/c.pem"}.Validate("x.", "http://gw:9443")
	require.ErrorContains(t, err, `--x.tls.* files are given but --x.gateway-url "http://gw:9443" is not https://`)
	require.ErrorContains(t, err, "--x.tls.cert-file and --x.tls.key-file go together")
}
