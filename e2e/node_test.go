package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/leasehold/leasehold/pkg/fleettest"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

const agentOperatorToken = "e2e-agent-operator-token-1"

// agentStack is two gateways behind HAProxy (nodeBalancer) and an api,
// for real leasehold-node processes.
type agentStack struct {
	db   *pgtest.DB
	gws  []fleettest.Gateway
	lb   string // the balancer's address, which the agents dial
	api  controlClient
	root string // parent of the agents' state directories
}

// bigMessage lets a 10 MiB file travel as one command and as live output.
const bigMessage = 16 << 20

func startAgentStack(t *testing.T) *agentStack {
	t.Helper()
	db := pgtest.NewDB(t)
	s := &agentStack{db: db, root: t.TempDir()}
	gwArgs := append([]string{"--gateway.max-message-bytes", strconv.Itoa(bigMessage), "--gateway.output-cap", strconv.Itoa(bigMessage)}, fleettest.FastGateway...)
	s.gws = []fleettest.Gateway{
		fleettest.StartGateway(t, db.URL, "gw_agent_a", gwArgs...),
		fleettest.StartGateway(t, db.URL, "gw_agent_b", gwArgs...),
	}
	s.lb = nodeBalancer(t, s.gws...)
	apiAddr := fleettest.Addr(t)
	args := append([]string{"--database-url", db.URL, "--http-addr", fleettest.Addr(t), "--id", "api_agent", "--log-format", "text",
		"--listen-addr", apiAddr, "--api.wait-poll-interval", "1s", "--api.max-message-bytes", strconv.Itoa(bigMessage),
		"--api.max-payload-bytes", strconv.Itoa(bigMessage - 1<<20)},
		fleettest.DBFlags(db.URL)...)
	p := proctest.Start(t, "api_agent", fleettest.Binary(t, "api"), []string{"LEASEHOLD_API_TOKENS=operator:" + agentOperatorToken}, args...)
	p.WaitReady(60 * time.Second)
	s.api = controlClient{controlv1connect.NewControlServiceClient(http.DefaultClient, "http://"+apiAddr), agentOperatorToken}
	return s
}

// startAgent runs leasehold-node as node id with credential cred, its
// state under s.root/id (kept across restarts of the same id), and waits
// until its session is up.
func (s *agentStack) startAgent(t *testing.T, id, cred string, extra ...string) *proctest.Proc {
	t.Helper()
	state := filepath.Join(s.root, id)
	require.NoError(t, os.MkdirAll(filepath.Join(state, "files"), 0o700))
	credFile := filepath.Join(state, "credential")
	if _, err := os.Stat(credFile); err != nil {
		require.NoError(t, os.WriteFile(credFile, []byte(cred+"\n"), 0o600))
	}
	args := append([]string{"--gateway-url", "http://" + s.lb, "--state-dir", state, "--node-id", id,
		"--http-addr", fleettest.Addr(t), "--log-format", "text", "--redial-backoff-max", "500ms",
		"--max-message-bytes", strconv.Itoa(bigMessage), "--output.max-bytes", strconv.Itoa(2 * bigMessage),
		"--file.roots", filepath.Join(state, "files")}, extra...)
	p := proctest.Start(t, id, fleettest.Binary(t, "node"), nil, args...)
	p.WaitReady(60 * time.Second)
	return p
}

// create creates a command of a typed kind on node.
func (s *agentStack) create(ctx context.Context, t *testing.T, node, kind string, payload proto.Message) string {
	t.Helper()
	b, err := protojson.Marshal(payload)
	require.NoError(t, err)
	r, err := s.api.CreateCommand(ctx, authed(s.api, &controlv1.CreateCommandRequest{NodeId: node, Kind: kind, Payload: b,
		Expiry: &controlv1.CreateCommandRequest_Timeout{Timeout: durationpb.New(2 * time.Minute)}}))
	require.NoError(t, err)
	return r.Msg.GetCommand().GetId()
}

// wait waits until command id is terminal and returns it with its result.
func (s *agentStack) wait(ctx context.Context, t *testing.T, id string) *controlv1.WaitCommandResponse {
	t.Helper()
	for {
		r, err := s.api.WaitCommand(ctx, authed(s.api, &controlv1.WaitCommandRequest{CommandId: id, Timeout: durationpb.New(20 * time.Second)}))
		require.NoError(t, err)
		switch r.Msg.GetCommand().GetState() {
		case controlv1.CommandState_COMMAND_STATE_SUCCEEDED, controlv1.CommandState_COMMAND_STATE_FAILED,
			controlv1.CommandState_COMMAND_STATE_CANCELLED, controlv1.CommandState_COMMAND_STATE_EXPIRED:
			return r.Msg
		}
		require.NoError(t, ctx.Err(), "command %s never ended", id)
	}
}

// pidAlive reports whether pid exists and is not a zombie.
func pidAlive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// pid (comm) state ...: the state follows the last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && i+2 < len(s) && s[i+2] != 'Z'
}

// readPids reads the pids a command wrote, one per line, once the file
// holds want of them.
func readPids(t *testing.T, path string, want int) []int {
	t.Helper()
	var pids []int
	require.Eventually(t, func() bool {
		b, err := os.ReadFile(path)
		if err != nil {
			return false
		}
		pids = pids[:0]
		for _, f := range strings.Fields(string(b)) {
			n, err := strconv.Atoi(f)
			if err != nil {
				return false
			}
			pids = append(pids, n)
		}
		return len(pids) >= want
	}, time.Minute, 20*time.Millisecond)
	return pids
}

// TestNodeAgentRunsRealCommands runs real leasehold-node processes behind a
// balancer in front of two gateways and an api, and drives them through
// the api as an operator would: exec returns a real program's output and
// exit status; output arrives live while the command runs; cancel ends a
// command that forked a background child and leaves no process of it; a
// timeout is honoured; file.put then file.get round-trips 10 MiB byte for
// byte; facts are this machine's; a command running when its agent is
// SIGKILLed is reported interrupted after the restart and not run again;
// a command running when its node's gateway is SIGKILLed still delivers
// its whole output and its result through the other gateway.
func TestNodeAgentRunsRealCommands(t *testing.T) {
	t.Parallel()
	s := startAgentStack(t)
	ids, creds := fleettest.RegisterNodes(t, s.db.Pool, "agent", 2)
	agent0 := s.startAgent(t, ids[0], creds[0])
	s.startAgent(t, ids[1], creds[1])
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	work := t.TempDir()

	t.Run("exec returns the program's output and exit status", func(t *testing.T) {
		want, err := exec.Command("uname", "-a").Output()
		require.NoError(t, err)
		r := s.wait(ctx, t, s.create(ctx, t, ids[1], "exec", &nodev1.ExecPayload{Argv: []string{"uname", "-a"}}))
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_SUCCEEDED, r.GetCommand().GetState(), "%v", r.GetResult())
		require.EqualValues(t, 0, r.GetResult().GetExitCode())
		got, _, err := readOutput(ctx, s.api, r.GetCommand().GetId(), 0, nil)
		require.NoError(t, err)
		require.Equal(t, string(want), string(got))

		r = s.wait(ctx, t, s.create(ctx, t, ids[1], "exec", &nodev1.ExecPayload{Argv: []string{"sh", "-c", "echo oops >&2; exit 3"}}))
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_FAILED, r.GetCommand().GetState())
		require.EqualValues(t, 3, r.GetResult().GetExitCode())
		require.Contains(t, string(r.GetResult().GetOutput()), "oops")
	})

	t.Run("live output arrives while the command runs", func(t *testing.T) {
		release := filepath.Join(work, "release")
		id := s.create(ctx, t, ids[0], "exec", &nodev1.ExecPayload{Argv: []string{"sh", "-c",
			fmt.Sprintf("echo first; while [ ! -e %s ]; do sleep 0.05; done; echo second", release)}})
		got, _, err := readOutput(ctx, s.api, id, 0, func(b []byte) bool { return string(b) == "first\n" })
		require.NoError(t, err)
		require.Equal(t, "first\n", string(got))
		require.NoError(t, os.WriteFile(release, nil, 0o600))
		r := s.wait(ctx, t, id)
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_SUCCEEDED, r.GetCommand().GetState())
		got, _, err = readOutput(ctx, s.api, id, 0, nil)
		require.NoError(t, err)
		require.Equal(t, "first\nsecond\n", string(got))
	})

	t.Run("cancel leaves no process of the command", func(t *testing.T) {
		pidFile := filepath.Join(work, "cancel.pids")
		id := s.create(ctx, t, ids[0], "exec", &nodev1.ExecPayload{Argv: []string{"sh", "-c",
			fmt.Sprintf("sleep 600 & echo $! >> %[1]s; echo $$ >> %[1]s; echo started; wait", pidFile)}})
		_, _, err := readOutput(ctx, s.api, id, 0, func(b []byte) bool { return string(b) == "started\n" })
		require.NoError(t, err)
		pids := readPids(t, pidFile, 2)
		for _, p := range pids {
			require.True(t, pidAlive(p), "pid %d runs before the cancel", p)
		}
		_, err = s.api.CancelCommand(ctx, authed(s.api, &controlv1.CancelCommandRequest{CommandId: id}))
		require.NoError(t, err)
		require.Eventually(t, func() bool {
			r, err := s.api.GetCommand(ctx, authed(s.api, &controlv1.GetCommandRequest{CommandId: id}))
			return err == nil && r.Msg.GetCommand().GetCancelConfirmed()
		}, time.Minute, 50*time.Millisecond)
		for _, p := range pids {
			require.False(t, pidAlive(p), "pid %d of the cancelled command still runs", p)
		}
	})

	t.Run("a background child does not outlive a finished command", func(t *testing.T) {
		pidFile := filepath.Join(work, "orphan.pids")
		r := s.wait(ctx, t, s.create(ctx, t, ids[0], "exec", &nodev1.ExecPayload{Argv: []string{"sh", "-c",
			fmt.Sprintf("sleep 600 >/dev/null 2>&1 & echo $! >> %s; echo done", pidFile)}}))
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_SUCCEEDED, r.GetCommand().GetState())
		pid := readPids(t, pidFile, 1)[0]
		require.Eventually(t, func() bool { return !pidAlive(pid) }, 30*time.Second, 20*time.Millisecond,
			"the background child %d of a finished command still runs", pid)
	})

	t.Run("a timeout is honoured", func(t *testing.T) {
		start := time.Now()
		r := s.wait(ctx, t, s.create(ctx, t, ids[0], "exec", &nodev1.ExecPayload{Argv: []string{"sleep", "600"},
			Timeout: durationpb.New(time.Second)}))
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_FAILED, r.GetCommand().GetState())
		require.NotZero(t, r.GetResult().GetExitCode())
		require.NotEmpty(t, r.GetResult().GetError())
		require.Less(t, time.Since(start), time.Minute, "sleep 600 was stopped")
	})

	t.Run("file.put then file.get round-trips 10 MiB", func(t *testing.T) {
		size := 10 << 20
		if testing.Short() {
			// The race detector's and PgBouncer's passes (-short) slow
			// every process several times: the same round trip with 1 MiB.
			size = 1 << 20
		}
		content := make([]byte, size)
		_, _ = rand.Read(content)
		sum := sha256.Sum256(content)
		path := filepath.Join(s.root, ids[1], "files", "blob.bin")
		r := s.wait(ctx, t, s.create(ctx, t, ids[1], "file.put", &nodev1.FilePutPayload{Path: path, Content: content, Mode: 0o640,
			Sha256: hex.EncodeToString(sum[:])}))
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_SUCCEEDED, r.GetCommand().GetState(), "%v", r.GetResult().GetError())
		st, err := os.Stat(path)
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o640), st.Mode().Perm())
		onDisk, err := os.ReadFile(path)
		require.NoError(t, err)
		require.True(t, bytes.Equal(content, onDisk), "the file on the node is byte-exact")

		id := s.create(ctx, t, ids[1], "file.get", &nodev1.FileGetPayload{Path: path})
		r = s.wait(ctx, t, id)
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_SUCCEEDED, r.GetCommand().GetState(), "%v", r.GetResult().GetError())
		got, truncated, err := readOutput(ctx, s.api, id, 0, nil)
		require.NoError(t, err)
		require.EqualValues(t, -1, truncated)
		require.True(t, bytes.Equal(content, got), "file.get returned %d bytes, want the %d put", len(got), size)
		require.Contains(t, string(r.GetResult().GetOutput()), hex.EncodeToString(sum[:]))
	})

	t.Run("facts are this machine's", func(t *testing.T) {
		r := s.wait(ctx, t, s.create(ctx, t, ids[1], "facts", &nodev1.FactsPayload{}))
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_SUCCEEDED, r.GetCommand().GetState(), "%v", r.GetResult().GetError())
		var facts map[string]any
		require.NoError(t, json.Unmarshal(r.GetResult().GetOutput(), &facts), "%s", r.GetResult().GetOutput())
		host, err := os.Hostname()
		require.NoError(t, err)
		require.Equal(t, host, facts["hostname"])
		var u syscall.Utsname
		require.NoError(t, syscall.Uname(&u))
		require.Contains(t, fmt.Sprint(facts["kernel"]), utsString(u.Release[:]))
	})

	t.Run("a command running when its agent is SIGKILLed is reported interrupted and not run again", func(t *testing.T) {
		runs := filepath.Join(work, "kill.runs")
		id := s.create(ctx, t, ids[0], "exec", &nodev1.ExecPayload{Argv: []string{"sh", "-c",
			fmt.Sprintf("echo $$ >> %s; echo started; exec sleep 600", runs)}})
		_, _, err := readOutput(ctx, s.api, id, 0, func(b []byte) bool { return string(b) == "started\n" })
		require.NoError(t, err)
		pid := readPids(t, runs, 1)[0]
		t.Cleanup(func() { _ = syscall.Kill(-pid, syscall.SIGKILL) }) // its group outlived the agent's SIGKILL
		agent0.Kill()
		agent0 = s.startAgent(t, ids[0], creds[0])
		r := s.wait(ctx, t, id)
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_FAILED, r.GetCommand().GetState())
		require.Contains(t, r.GetResult().GetError(), "not run again")
		require.Len(t, readPids(t, runs, 1), 1, "the command ran once")
	})

	t.Run("a gateway's SIGKILL mid-command loses neither output nor result", func(t *testing.T) {
		if testing.Short() {
			t.Skip("-short: the gateway failover case runs in the full suite")
		}
		release := filepath.Join(work, "gw.release")
		id := s.create(ctx, t, ids[1], "exec", &nodev1.ExecPayload{Argv: []string{"sh", "-c",
			fmt.Sprintf("echo before; while [ ! -e %s ]; do sleep 0.05; done; echo after", release)}})
		_, _, err := readOutput(ctx, s.api, id, 0, func(b []byte) bool { return string(b) == "before\n" })
		require.NoError(t, err)
		var holder string
		require.NoError(t, s.db.Pool.QueryRow(ctx, `SELECT gateway_id FROM node_sessions WHERE node_id = $1`, ids[1]).Scan(&holder))
		killed := 0
		for _, g := range s.gws {
			if g.Name == holder {
				g.Kill()
				killed++
			}
		}
		require.Equal(t, 1, killed, "the gateway %q holding the node's session was killed", holder)
		require.NoError(t, os.WriteFile(release, nil, 0o600))
		r := s.wait(ctx, t, id)
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_SUCCEEDED, r.GetCommand().GetState(), "%v", r.GetResult())
		got, _, err := readOutput(ctx, s.api, id, 0, nil)
		require.NoError(t, err)
		require.Equal(t, "before\nafter\n", string(got))
	})

	t.Run("bad payloads are refused at the api and nothing is written", func(t *testing.T) {
		for _, c := range []struct{ kind, payload, field string }{
			{"exec", `{"argv":[]}`, "payload.argv"},
			{"exec", `{"argv":["ls"],"bogus":1}`, "payload"},
			{"file.put", `{"path":"relative/path","content":""}`, "payload.path"},
			{"exec", `not json`, "payload"},
		} {
			_, err := s.api.CreateCommand(ctx, authed(s.api, &controlv1.CreateCommandRequest{NodeId: ids[0], Kind: c.kind, Payload: []byte(c.payload)}))
			require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%s %s", c.kind, c.payload)
			require.ErrorContains(t, err, c.field)
		}
		n, err := queryInt(s.db.Pool, `SELECT count(*) FROM commands WHERE payload = ANY($1)`,
			[][]byte{[]byte(`{"argv":[]}`), []byte(`not json`)})
		require.NoError(t, err)
		require.Zero(t, n)
	})
}

func utsString(b []int8) string {
	out := make([]byte, 0, len(b))
	for _, c := range b {
		if c == 0 {
			break
		}
		out = append(out, byte(c))
	}
	return string(out)
}
