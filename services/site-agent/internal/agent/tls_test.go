package agent

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/fleettest"
	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/nodereg"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/reload"
	"github.com/leasehold/leasehold/pkg/tlstest"
)

// TestSiteAgentJoinsAnMTLSGateway: a gateway that requires client
// certificates (--tls-client-ca) welcomes a site agent given the CA bundle
// and a certificate naming it (--tls.ca-file, --tls.cert-file,
// --tls.key-file), as it does a node.
func TestSiteAgentJoinsAnMTLSGateway(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	db := pgtest.NewDB(t)
	ca := tlstest.NewCA(t)
	caFile := ca.WriteCA(t)
	srvCert, srvKey := tlstest.WriteKeyPair(t, ca.Server(t))
	gw := fleettest.StartGateway(t, db.URL, "gw_site_mtls", append(append([]string{}, siteGatewayArgs...),
		"--tls-cert", srvCert, "--tls-key", srvKey, "--tls-client-ca", caFile)...)
	cred, err := nodereg.Register(context.Background(), db.Pool, nodereg.Node{ID: "agent-tls", Kind: "site_agent", SiteID: "site1"})
	require.NoError(t, err)

	cfg := func(cert, key string) func(*Config) {
		return func(c *Config) {
			c.GatewayURL = "https://" + gw.Listen
			c.TLS = reload.ClientTLSFiles{CA: caFile, Cert: cert, Key: key}
		}
	}
	mine, mineKey := tlstest.WriteKeyPair(t, ca.Client(t, "", nodeauth.NodeURI("agent-tls")))
	a := startAgent(t, "agent-tls", "site1", cred, gw.Listen, &syncBuf{}, cfg(mine, mineKey))
	require.Eventually(t, func() bool { return a.d.Welcome() != nil }, time.Minute, 50*time.Millisecond,
		"the agent's session over mTLS")
}
