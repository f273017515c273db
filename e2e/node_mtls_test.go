package e2e

import (
	"context"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/fleettest"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
	"github.com/leasehold/leasehold/pkg/tlstest"
)

// TestNodeAgentOverMutualTLS runs the leasehold-node binary against a
// gateway that requires client certificates bound to node ids: with the
// CA file and its own certificate (URI SAN leasehold://node/<id>) it is
// welcomed and runs a real command; with a certificate that names another
// node it refuses to start, naming the file; without a client certificate
// it never gets a session (the handshake fails) and says so in its log.
func TestNodeAgentOverMutualTLS(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ca := tlstest.NewCA(t)
	caFile := ca.WriteCA(t)
	gwCert, gwKey := tlstest.WriteKeyPair(t, ca.Server(t))
	gw := fleettest.StartGateway(t, db.URL, "gw_mtls", append([]string{"--tls-cert", gwCert, "--tls-key", gwKey, "--tls-client-ca", caFile},
		fleettest.FastGateway...)...)
	apiAddr := fleettest.Addr(t)
	api := proctest.Start(t, "api_mtls", fleettest.Binary(t, "api"), []string{"LEASEHOLD_API_TOKENS=operator:" + agentOperatorToken},
		append([]string{"--database-url", db.URL, "--http-addr", fleettest.Addr(t), "--id", "api_mtls", "--log-format", "text",
			"--listen-addr", apiAddr}, fleettest.DBFlags(db.URL)...)...)
	api.WaitReady(60 * time.Second)
	c := controlClient{controlv1connect.NewControlServiceClient(http.DefaultClient, "http://"+apiAddr), agentOperatorToken}
	ids, creds := fleettest.RegisterNodes(t, db.Pool, "mtls", 2)

	start := func(id, cred, certCN string, withCert bool) *proctest.Proc {
		state := t.TempDir()
		require.NoError(t, os.WriteFile(filepath.Join(state, "credential"), []byte(cred+"\n"), 0o600))
		args := []string{"--gateway-url", "https://" + gw.Listen, "--state-dir", state, "--node-id", id,
			"--http-addr", fleettest.Addr(t), "--log-format", "text", "--redial-backoff-max", "500ms", "--tls.ca-file", caFile}
		if withCert {
			cert, key := tlstest.WriteKeyPair(t, ca.Client(t, certCN, "leasehold://node/"+certCN))
			args = append(args, "--tls.cert-file", cert, "--tls.key-file", key)
		}
		return proctest.Start(t, id, fleettest.Binary(t, "node"), nil, args...)
	}

	// Its own certificate: welcomed, and a real command runs.
	p := start(ids[0], creds[0], ids[0], true)
	p.WaitReady(60 * time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	payload := []byte(`{"argv":["sh","-c","echo over mtls"]}`)
	created, err := c.CreateCommand(ctx, authed(c, &controlv1.CreateCommandRequest{NodeId: ids[0], Kind: "exec", Payload: payload}))
	require.NoError(t, err)
	w, err := c.WaitCommand(ctx, authed(c, &controlv1.WaitCommandRequest{CommandId: created.Msg.GetCommand().GetId()}))
	require.NoError(t, err)
	require.Equal(t, controlv1.CommandState_COMMAND_STATE_SUCCEEDED, w.Msg.GetCommand().GetState(), "%v", w.Msg.GetResult())
	require.Equal(t, "over mtls\n", string(w.Msg.GetResult().GetOutput()))

	// A certificate naming another node: refused at start, naming the file.
	other := start(ids[1], creds[1], ids[0], true)
	require.Eventually(t, other.Exited, 30*time.Second, 20*time.Millisecond, "an agent with another node's certificate does not start")
	require.Regexp(t, `--tls.cert-file and --node-id: client certificate \S+ names node \\?"`+ids[0]+`\\?", not \\?"`+ids[1], other.Logs())

	// No client certificate: the gateway's handshake refuses every dial.
	bare := start(ids[1], creds[1], "", false)
	require.Eventually(t, func() bool {
		return strings.Contains(bare.Logs(), "cannot open a session with the gateway; redialling")
	}, 30*time.Second, 50*time.Millisecond, "the agent says it cannot open a session")
	var sessions int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM node_sessions WHERE node_id = $1`, ids[1]).Scan(&sessions))
	require.Zero(t, sessions, "no session without a client certificate")
}
