package daemon

import (
	"context"
	"crypto/tls"
	"testing"

	"github.com/stretchr/testify/require"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/tlstest"
)

func TestNewRefusesACertificateNamingAnotherNode(t *testing.T) {
	ca := tlstest.NewCA(t)
	handler := func(context.Context, *nodev1.Command) Outcome { return Outcome{} }
	cfg := func(cert tls.Certificate) Config {
		return Config{Address: "https://127.0.0.1:1", NodeID: "n-1", Credential: "c", Handler: handler,
			TLS: &tls.Config{Certificates: []tls.Certificate{cert}}}
	}
	for _, tc := range []struct {
		name    string
		cert    tls.Certificate
		wantErr string
	}{
		{"URI names this node", ca.Client(t, "", nodeauth.NodeURI("n-1")), ""},
		{"host certificate names no node", ca.Client(t, "host-17.example"), ""},
		{"CN only: the gateway decides", ca.Client(t, "n-2"), ""},
		{"URI names another node", ca.Client(t, "", nodeauth.NodeURI("n-2")), `names node "n-2", not NodeID "n-1"`},
		{"two nodes", ca.Client(t, "", nodeauth.NodeURI("n-1"), nodeauth.NodeURI("n-2")), "more than one node"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(cfg(tc.cert))
			if tc.wantErr == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tc.wantErr)
		})
	}
}
