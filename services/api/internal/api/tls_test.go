package api

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
)

func selfSigned(t *testing.T) (certFile, keyFile string, pool *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "leasehold-api-test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	pool = x509.NewCertPool()
	pool.AddCert(cert)
	kb, err := x509.MarshalECPrivateKey(key)
	require.NoError(t, err)
	dir := t.TempDir()
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	require.NoError(t, os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600))
	require.NoError(t, os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600))
	return certFile, keyFile, pool
}

func TestTLSServesHTTP1AndHTTP2(t *testing.T) {
	t.Parallel()
	certFile, keyFile, pool := selfSigned(t)
	b := setup(t, func(c *Config, tr *http.Transport) {
		c.TLSCert, c.TLSKey = certFile, keyFile
		tr.TLSClientConfig = &tls.Config{RootCAs: pool}
		tr.ForceAttemptHTTP2 = true
	})
	_, err := b.viewer.ListNodes(ctxT(t), connect.NewRequest(&controlv1.ListNodesRequest{}))
	require.NoError(t, err)
	resp, err := b.http.Get(b.base + "/leasehold.control.v1.ControlService/ListNodes")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, 2, resp.ProtoMajor, "HTTP/2 over TLS")

	h1 := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}
	defer h1.CloseIdleConnections()
	resp, err = (&http.Client{Transport: h1}).Get(b.base + "/leasehold.control.v1.ControlService/ListNodes")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, 1, resp.ProtoMajor, "HTTP/1.1 over TLS")
}
