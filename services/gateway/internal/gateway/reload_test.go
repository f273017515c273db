package gateway

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
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/tlstest"
)

// TestTLSRotationWithoutRestart: a running gateway serves a renewed
// certificate and trusts a rotated client CA on new handshakes, on both
// HTTP/2 servers; the old CA's nodes are refused from then on.
func TestTLSRotationWithoutRestart(t *testing.T) {
	t.Parallel()
	for _, server := range []string{HTTP2Lean, HTTP2Std} {
		t.Run(server, func(t *testing.T) {
			t.Parallel()
			db := pgtest.NewDB(t)
			serverCA, oldCA, newCA := tlstest.NewCA(t), tlstest.NewCA(t), tlstest.NewCA(t)
			dir := t.TempDir()
			cfg := testConfig()
			cfg.HTTP2Server = server
			cfg.TLSCert, cfg.TLSKey, cfg.TLSClientCA = filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"), filepath.Join(dir, "ca.crt")
			cfg.TLSReloadInterval = 20 * time.Millisecond
			first, second := serverCA.Server(t), serverCA.Server(t)
			rename := func(from, to string) { require.NoError(t, os.Rename(from, to)) }
			install := func(c tls.Certificate, ca *tlstest.CA) {
				cf, kf := tlstest.WriteKeyPair(t, c)
				rename(ca.WriteCA(t), cfg.TLSClientCA)
				rename(cf, cfg.TLSCert)
				rename(kf, cfg.TLSKey)
			}
			install(first, oldCA)
			g := startGateway(t, db, cfg)
			creds := registerNodes(t, db, "n", 2)
			oldClient, newClient := oldCA.Client(t, "", nodeauth.NodeURI("n-0")), newCA.Client(t, "", nodeauth.NodeURI("n-1"))

			// served handshakes with client and returns the serving
			// certificate's serial, or the refusal.
			served := func(client tls.Certificate) (string, error) {
				cc := clientTLS(serverCA, client)
				cc.ServerName, cc.NextProtos = "localhost", []string{"h2"}
				c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", g.Addr(), cc)
				if err != nil {
					return "", err
				}
				defer c.Close()
				// TLS 1.3 reports a refused client certificate on the first
				// read; an accepted one gets the server's SETTINGS frame
				// after the client preface.
				_ = c.SetDeadline(time.Now().Add(5 * time.Second))
				if _, err := io.WriteString(c, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00"); err != nil {
					return "", err
				}
				if _, err := io.ReadFull(c, make([]byte, 9)); err != nil {
					return "", err
				}
				return c.ConnectionState().PeerCertificates[0].SerialNumber.String(), nil
			}
			serial, err := served(oldClient)
			require.NoError(t, err)
			require.Equal(t, first.Leaf.SerialNumber.String(), serial)
			_, err = served(newClient)
			require.Error(t, err, "the new CA is not trusted yet")

			install(second, newCA)
			require.Eventually(t, func() bool {
				serial, err := served(newClient)
				return err == nil && serial == second.Leaf.SerialNumber.String()
			}, 20*time.Second, 20*time.Millisecond, "the renewed certificate and the new CA serve new handshakes")
			_, err = served(oldClient)
			require.Error(t, err, "the old CA's nodes are refused once it is rotated out")
			dialMTLS(t, g.Addr(), serverCA, newClient).welcome(t, "n-1", creds[1])
		})
	}
}
