package api

import (
	"crypto/tls"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/tlstest"
)

// replace writes b to path through a rename, as a Secret update does.
func replace(t *testing.T, path string, b []byte) {
	t.Helper()
	tmp := path + ".new"
	require.NoError(t, os.WriteFile(tmp, b, 0o600))
	require.NoError(t, os.Rename(tmp, path))
}

func TestTokensFileRotatesWithoutRestart(t *testing.T) {
	t.Parallel()
	const oldToken, newToken = "rotated-out-token-5c1e9a", "rotated-in-token-7d2f0b"
	path := filepath.Join(t.TempDir(), "tokens")
	replace(t, path, []byte("operator:"+oldToken+"\n"))
	b := setup(t, func(c *Config, _ *http.Transport) {
		c.TokensFile, c.ReloadInterval = path, 20*time.Millisecond
	})
	b.secret(oldToken)
	b.secret(newToken)
	list := func(token string) error {
		_, err := b.client(token).ListNodes(ctxT(t), connect.NewRequest(&controlv1.ListNodesRequest{}))
		return err
	}
	require.NoError(t, list(oldToken))
	require.Equal(t, connect.CodeUnauthenticated, connect.CodeOf(list(newToken)))

	replace(t, path, []byte("# rotated\noperator:"+newToken+"\n"))
	require.Eventually(t, func() bool { return list(newToken) == nil }, 20*time.Second, 20*time.Millisecond,
		"the new token is accepted without a restart")
	require.Equal(t, connect.CodeUnauthenticated, connect.CodeOf(list(oldToken)), "the old token is refused")
	require.NoError(t, list(viewerToken), "the inline tokens stay")

	// A broken file keeps the tokens in force.
	replace(t, path, []byte("operator:short\n"))
	require.Eventually(t, func() bool {
		return b.metric("leasehold_config_reload_failing", `config="api-tokens"`) == 1
	}, 20*time.Second, 20*time.Millisecond)
	require.NoError(t, list(newToken))
}

func TestTLSCertificateRotatesWithoutRestart(t *testing.T) {
	t.Parallel()
	ca := tlstest.NewCA(t)
	first, second := ca.Server(t), ca.Server(t)
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	install := func(c tls.Certificate) {
		cf, kf := tlstest.WriteKeyPair(t, c)
		require.NoError(t, os.Rename(cf, certFile))
		require.NoError(t, os.Rename(kf, keyFile))
	}
	install(first)
	b := setup(t, func(c *Config, tr *http.Transport) {
		c.TLSCert, c.TLSKey, c.ReloadInterval = certFile, keyFile, 20*time.Millisecond
		tr.TLSClientConfig = &tls.Config{RootCAs: ca.Pool()}
	})
	served := func() string {
		c, err := tls.Dial("tcp", b.svc.Addr(), &tls.Config{RootCAs: ca.Pool(), ServerName: "localhost"})
		require.NoError(t, err)
		defer c.Close()
		return c.ConnectionState().PeerCertificates[0].SerialNumber.String()
	}
	require.Equal(t, first.Leaf.SerialNumber.String(), served())
	require.Equal(t, float64(first.Leaf.NotAfter.Unix()), b.metric("leasehold_tls_certificate_expiry_timestamp_seconds", `cert="serving"`))

	install(second)
	require.Eventually(t, func() bool { return served() == second.Leaf.SerialNumber.String() }, 20*time.Second, 20*time.Millisecond)
	require.Equal(t, float64(second.Leaf.NotAfter.Unix()), b.metric("leasehold_tls_certificate_expiry_timestamp_seconds", `cert="serving"`))
	_, err := b.viewer.ListNodes(ctxT(t), connect.NewRequest(&controlv1.ListNodesRequest{}))
	require.NoError(t, err, "ControlService over the renewed certificate")
}

// metric is the value of the series of name whose labels include label
// (`k="v"`), or -1 when there is none.
func (b *bundle) metric(name, label string) float64 {
	b.t.Helper()
	mfs, err := b.reg.Gather()
	require.NoError(b.t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName()+`="`+lp.GetValue()+`"` == label {
					if m.GetGauge() != nil {
						return m.GetGauge().GetValue()
					}
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return -1
}

// TestTokensFileTypoDoesNotKeepARevokedToken: an edit that removes one
// token and demotes another but has a typo on a third line does not parse
// (nothing is added, the reload alert fires), yet the removed token stops
// working and the demoted one loses its role at once.
func TestTokensFileTypoDoesNotKeepARevokedToken(t *testing.T) {
	t.Parallel()
	const kept, revoked, demoted, added = "kept-token-0123456789ab", "revoked-token-0123456789", "demoted-token-0123456789", "added-token-0123456789ab"
	path := filepath.Join(t.TempDir(), "tokens")
	replace(t, path, []byte("operator:"+kept+"\noperator:"+revoked+"\nadmin:"+demoted+"\n"))
	b := setup(t, func(c *Config, _ *http.Transport) {
		c.TokensFile, c.ReloadInterval = path, 20*time.Millisecond
	})
	for _, s := range []string{kept, revoked, demoted, added} {
		b.secret(s)
	}
	list := func(token string) error {
		_, err := b.client(token).ListNodes(ctxT(t), connect.NewRequest(&controlv1.ListNodesRequest{}))
		return err
	}
	cordon := func(token string) error { // admin only
		_, err := b.client(token).CordonNode(ctxT(t), connect.NewRequest(&controlv1.CordonNodeRequest{NodeId: "no-such-node"}))
		return err
	}
	require.NoError(t, list(revoked))
	require.Equal(t, connect.CodeNotFound, connect.CodeOf(cordon(demoted)), "an admin reaches the handler")

	replace(t, path, []byte("operator:"+kept+"\nviewer:"+demoted+"\noperator:"+added+"\nopertor:typo-token-0123456789\n"))
	require.Eventually(t, func() bool { return connect.CodeOf(list(revoked)) == connect.CodeUnauthenticated }, 20*time.Second, 20*time.Millisecond,
		"a token the file no longer lists is revoked though another line does not parse")
	require.Equal(t, 1.0, b.metric("leasehold_config_reload_failing", `config="api-tokens"`), "the reload still fails")
	require.Equal(t, connect.CodePermissionDenied, connect.CodeOf(cordon(demoted)), "the demotion applies")
	require.NoError(t, list(demoted))
	require.NoError(t, list(kept))
	require.Equal(t, connect.CodeUnauthenticated, connect.CodeOf(list(added)), "nothing is added from a file that does not parse")
}
