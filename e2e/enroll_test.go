package e2e

import (
	"context"
	"errors"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/leasehold/leasehold/pkg/fleettest"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	"github.com/leasehold/leasehold/pkg/nodereg"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

const enrollAdminToken = "e2e-enroll-admin-token-01"

// nodeCLI runs the leasehold-node binary with args and the join token in
// its environment, and returns its exit code and combined output.
func nodeCLI(t *testing.T, token string, args ...string) (int, string) {
	t.Helper()
	cmd := exec.Command(fleettest.Binary(t, "node"), args...)
	cmd.Env = []string{"PATH=/usr/bin:/bin"}
	if token != "" {
		cmd.Env = append(cmd.Env, "LEASEHOLD_JOIN_TOKEN="+token)
	}
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode(), string(out)
	}
	require.NoError(t, err, string(out))
	return 0, string(out)
}

// TestNodeJoinsRotatesAndIsRefused enrolls real machines the way an
// operator does: a join token from the api, `leasehold-node join` on each
// machine, the agent started on the credential it wrote. A one-use token
// serves one machine only; an expired token is refused; a credential file
// others can read stops the agent naming the file; `rotate-credential`
// replaces the credential while the session stays up, the agent's next
// session uses the new one, and the old one is refused after its grace; a
// revoked node's agent is refused.
func TestNodeJoinsRotatesAndIsRefused(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	gw := fleettest.StartGateway(t, db.URL, "gw_enroll", fleettest.FastGateway...)
	apiAddr := fleettest.Addr(t)
	args := append([]string{"--database-url", db.URL, "--http-addr", fleettest.Addr(t), "--id", "api_enroll", "--log-format", "text",
		"--listen-addr", apiAddr}, fleettest.DBFlags(db.URL)...)
	p := proctest.Start(t, "api_enroll", fleettest.Binary(t, "api"), []string{"LEASEHOLD_API_TOKENS=admin:" + enrollAdminToken}, args...)
	p.WaitReady(60 * time.Second)
	api := controlClient{controlv1connect.NewControlServiceClient(http.DefaultClient, "http://"+apiAddr), enrollAdminToken}
	apiURL := "http://" + apiAddr
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	root := t.TempDir()

	tok, err := api.CreateJoinToken(ctx, authed(api, &controlv1.CreateJoinTokenRequest{MaxUses: 1,
		Labels: map[string]string{"fleet": "e2e"}, Ttl: durationpb.New(time.Hour)}))
	require.NoError(t, err)
	secret := tok.Msg.GetToken()

	stateA, stateB := filepath.Join(root, "a"), filepath.Join(root, "b")
	code, out := nodeCLI(t, secret, "join", "--api-url", apiURL, "--state-dir", stateA, "--node-id", "enroll-a")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "joined as node enroll-a")
	st, err := os.Stat(filepath.Join(stateA, "credential"))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())

	code, out = nodeCLI(t, secret, "join", "--api-url", apiURL, "--state-dir", stateB, "--node-id", "enroll-b")
	require.Equal(t, 1, code, out)
	require.Contains(t, out, "used up")
	_, err = os.Stat(filepath.Join(stateB, "credential"))
	require.ErrorIs(t, err, os.ErrNotExist, "a refused join writes no credential")
	n, err := queryInt(db.Pool, `SELECT count(*) FROM nodes WHERE id = 'enroll-b'`)
	require.NoError(t, err)
	require.Zero(t, n)

	expired, err := api.CreateJoinToken(ctx, authed(api, &controlv1.CreateJoinTokenRequest{Ttl: durationpb.New(time.Hour)}))
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `UPDATE join_tokens SET created_at = compute_now() - interval '2 hours', expires_at = compute_now() - interval '1 second' WHERE id = $1`, expired.Msg.GetJoinToken().GetId())
	require.NoError(t, err)
	code, out = nodeCLI(t, expired.Msg.GetToken(), "join", "--api-url", apiURL, "--state-dir", stateB, "--node-id", "enroll-b")
	require.Equal(t, 1, code, out)
	require.Contains(t, out, "expired")

	code, out = nodeCLI(t, "", "join", "--api-url", apiURL, "--state-dir", stateB)
	require.Equal(t, 2, code, out)
	require.Contains(t, out, "LEASEHOLD_JOIN_TOKEN", "a missing token is a usage error naming where it comes from")

	agentArgs := func(state, id string) []string {
		return []string{"--gateway-url", gw.URL(), "--state-dir", state, "--node-id", id, "--http-addr", fleettest.Addr(t),
			"--log-format", "text", "--redial-backoff-max", "500ms"}
	}
	credFile := filepath.Join(stateA, "credential")

	t.Run("a credential file others can read stops the agent", func(t *testing.T) {
		require.NoError(t, os.Chmod(credFile, 0o644))
		defer func() { require.NoError(t, os.Chmod(credFile, 0o600)) }()
		bad := proctest.Start(t, "enroll-a-exposed", fleettest.Binary(t, "node"), nil, agentArgs(stateA, "enroll-a")...)
		require.Equal(t, 2, bad.Wait(30*time.Second), bad.Logs())
		require.Contains(t, bad.Logs(), credFile)
		require.Contains(t, bad.Logs(), "0644")
	})

	agent := proctest.Start(t, "enroll-a", fleettest.Binary(t, "node"), nil, agentArgs(stateA, "enroll-a")...)
	agent.WaitReady(60 * time.Second)
	node, err := api.GetNode(ctx, authed(api, &controlv1.GetNodeRequest{NodeId: "enroll-a"}))
	require.NoError(t, err)
	require.Equal(t, "e2e", node.Msg.GetNode().GetLabels()["fleet"], "the token's labels are the node's")

	outer := t
	t.Run("rotation keeps the session and retires the old credential", func(t *testing.T) {
		old, err := os.ReadFile(credFile)
		require.NoError(t, err)
		code, out := nodeCLI(t, "", "rotate-credential", "--api-url", apiURL, "--state-dir", stateA, "--grace", "2s")
		require.Equal(t, 0, code, out)
		fresh, err := os.ReadFile(credFile)
		require.NoError(t, err)
		require.NotEqual(t, string(old), string(fresh))
		status, _, err := agent.Get("/readyz", "")
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, status, "the open session survives the rotation")

		// The agent's next session (after a restart here) authenticates
		// with the new file.
		agent.Signal(syscall.SIGTERM)
		require.Equal(t, 0, agent.Wait(30*time.Second), agent.Logs())
		agent = proctest.Start(outer, "enroll-a-rotated", fleettest.Binary(t, "node"), nil, agentArgs(stateA, "enroll-a")...)
		agent.WaitReady(60 * time.Second)

		require.Eventually(t, func() bool {
			_, err := nodereg.Verify(ctx, db.Pool, "enroll-a", strings.TrimSpace(string(old)))
			return errors.Is(err, nodereg.ErrUnauthenticated)
		}, 30*time.Second, 100*time.Millisecond, "the old credential is refused once its grace ended")
		_, err = nodereg.Verify(ctx, db.Pool, "enroll-a", strings.TrimSpace(string(fresh)))
		require.NoError(t, err)
	})

	t.Run("a command runs on the joined node", func(t *testing.T) {
		r, err := api.CreateCommand(ctx, authed(api, &controlv1.CreateCommandRequest{NodeId: "enroll-a", Kind: "exec",
			Payload: []byte(`{"argv":["echo","joined"]}`)}))
		require.NoError(t, err)
		w, err := api.WaitCommand(ctx, authed(api, &controlv1.WaitCommandRequest{CommandId: r.Msg.GetCommand().GetId(), Timeout: durationpb.New(time.Minute)}))
		require.NoError(t, err)
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_SUCCEEDED, w.Msg.GetCommand().GetState())
		require.Equal(t, "joined\n", string(w.Msg.GetResult().GetOutput()))
	})

	t.Run("a revoked node is refused", func(t *testing.T) {
		_, err := api.RevokeNode(ctx, authed(api, &controlv1.RevokeNodeRequest{NodeId: "enroll-a"}))
		require.NoError(t, err)
		require.NoError(t, agent.AwaitStatus(ctx, "/readyz", http.StatusServiceUnavailable, time.Minute), "the revoked node's session ends")
		_, err = api.CreateCommand(ctx, authed(api, &controlv1.CreateCommandRequest{NodeId: "enroll-a", Kind: "exec",
			Payload: []byte(`{"argv":["true"]}`)}))
		require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err))
	})
}
