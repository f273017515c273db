package nodeauth_test

import (
	"crypto/x509"
	"crypto/x509/pkix"
	"net/url"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/tlstest"
)

// TestNodeIDFromCert reads real certificates (signed, DER-encoded and parsed
// back, so the URIs are what crypto/x509 makes of them).
func TestNodeIDFromCert(t *testing.T) {
	t.Parallel()
	ca := tlstest.NewCA(t)
	for _, c := range []struct {
		name    string
		cn      string
		uris    []string
		want    string
		wantErr error
	}{
		{name: "URI SAN", uris: []string{"leasehold://node/n-1"}, want: "n-1"},
		{name: "URI SAN wins over the CommonName", cn: "n-2", uris: []string{"leasehold://node/n-1"}, want: "n-1"},
		{name: "URI SAN beside other URIs", cn: "host.example", uris: []string{"spiffe://example.org/host", "leasehold://node/n-1"}, want: "n-1"},
		{name: "id with the whole alphabet", uris: []string{"leasehold://node/a.B_c:9@x-1"}, want: "a.B_c:9@x-1"},
		{name: "scheme and host are case-insensitive", uris: []string{"LEASEHOLD://NODE/n-1"}, want: "n-1"},
		{name: "same node twice", uris: []string{"leasehold://node/n-1", "leasehold://node/n-1"}, want: "n-1"},
		{name: "CommonName fallback", cn: "n-1", want: "n-1"},
		{name: "CommonName fallback beside non-leasehold URIs", cn: "n-1", uris: []string{"spiffe://example.org/n-2"}, want: "n-1"},

		{name: "two nodes", uris: []string{"leasehold://node/n-1", "leasehold://node/n-2"}, wantErr: nodeauth.ErrCertManyNodes},
		{name: "two nodes differing in case", uris: []string{"leasehold://node/n-1", "leasehold://node/N-1"}, wantErr: nodeauth.ErrCertManyNodes},
		{name: "no identity", wantErr: nodeauth.ErrCertNoNode},
		{name: "CommonName not a node id", cn: "node one", wantErr: nodeauth.ErrCertNoNode},
		{name: "non-leasehold URI only, no CommonName", uris: []string{"spiffe://example.org/n-1"}, wantErr: nodeauth.ErrCertNoNode},
		{name: "malformed leasehold URI never falls back to the CommonName", cn: "n-1", uris: []string{"leasehold://site/s-1"}, wantErr: nodeauth.ErrCertBadNodeURI},
		{name: "malformed URI beside a good one", uris: []string{"leasehold://node/n-1", "leasehold://node/n-1/x"}, wantErr: nodeauth.ErrCertBadNodeURI},
		{name: "empty id", uris: []string{"leasehold://node/"}, wantErr: nodeauth.ErrCertBadNodeURI},
		{name: "no path", uris: []string{"leasehold://node"}, wantErr: nodeauth.ErrCertBadNodeURI},
		{name: "port", uris: []string{"leasehold://node:1/n-1"}, wantErr: nodeauth.ErrCertBadNodeURI},
		{name: "user", uris: []string{"leasehold://n-2@node/n-1"}, wantErr: nodeauth.ErrCertBadNodeURI},
		{name: "query", uris: []string{"leasehold://node/n-1?as=n-2"}, wantErr: nodeauth.ErrCertBadNodeURI},
		{name: "fragment", uris: []string{"leasehold://node/n-1#n-2"}, wantErr: nodeauth.ErrCertBadNodeURI},
		{name: "percent-escaped", uris: []string{"leasehold://node/n%2D1"}, wantErr: nodeauth.ErrCertBadNodeURI},
		{name: "escaped slash", uris: []string{"leasehold://node/a%2Fb"}, wantErr: nodeauth.ErrCertBadNodeURI},
		{name: "opaque", uris: []string{"leasehold:node/n-1"}, wantErr: nodeauth.ErrCertBadNodeURI},
		{name: "invalid id", uris: []string{"leasehold://node/n!1"}, wantErr: nodeauth.ErrCertBadNodeURI},
	} {
		t.Run(c.name, func(t *testing.T) {
			cert := ca.Client(t, c.cn, c.uris...).Leaf
			got, err := nodeauth.NodeIDFromCert(cert)
			if c.wantErr != nil {
				require.ErrorIs(t, err, c.wantErr)
				require.Empty(t, got)
				return
			}
			require.NoError(t, err)
			require.Equal(t, c.want, got)
		})
	}
}

// TestNodeIDFromCertWithoutCertificate covers inputs a TLS stack cannot
// produce: nil, and a nil URI.
func TestNodeIDFromCertWithoutCertificate(t *testing.T) {
	t.Parallel()
	_, err := nodeauth.NodeIDFromCert(nil)
	require.ErrorIs(t, err, nodeauth.ErrCertNoNode)
	id, err := nodeauth.NodeIDFromCert(&x509.Certificate{Subject: pkix.Name{CommonName: "n-1"}, URIs: []*url.URL{nil}})
	require.NoError(t, err)
	require.Equal(t, "n-1", id)
}

func TestNodeURIRoundTrips(t *testing.T) {
	t.Parallel()
	u, err := url.Parse(nodeauth.NodeURI("n-1"))
	require.NoError(t, err)
	id, err := nodeauth.NodeIDFromCert(&x509.Certificate{URIs: []*url.URL{u}})
	require.NoError(t, err)
	require.Equal(t, "n-1", id)
}
