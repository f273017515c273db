package api

import (
	"crypto/tls"
	"crypto/x509"
	"net/http"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/tlstest"
)

// selfSigned writes a server certificate for 127.0.0.1 issued by a fresh
// test CA and returns the files and a pool trusting the CA.
func selfSigned(t *testing.T) (certFile, keyFile string, pool *x509.CertPool) {
	t.Helper()
	ca := tlstest.NewCA(t)
	certFile, keyFile = tlstest.WriteKeyPair(t, ca.Server(t))
	return certFile, keyFile, ca.Pool()
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
