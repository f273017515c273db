package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/leasehold/leasehold/pkg/fleettest"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// windowScript is the exec command of TestRunOnRealNodes, run by sh with
// the run's work directory as $1. Under an flock it counts itself into
// the commands running now and appends "<its agent's pid> <that count>"
// to starts (its parent is the leasehold-node that started it: the agent
// runs the program itself, with no shell between), holds for a second,
// then counts itself out. A second is many times the spread between the
// starts of commands a worker hands out together, so commands let run side
// by side are counted side by side.
const windowScript = `d=$1
exec 9>>"$d/lock"
flock 9
n=$(cat "$d/in-flight" 2>/dev/null)
n=$((${n:-0} + 1))
echo "$n" > "$d/in-flight"
echo "$PPID $n" >> "$d/starts"
flock -u 9
sleep 1
flock 9
n=$(cat "$d/in-flight")
echo "$((n - 1))" > "$d/in-flight"
flock -u 9
echo held`

// TestRunOnRealNodes runs a run of exec through the api, driven by a real
// worker, over three real leasehold-node processes with max_in_flight 1:
// the run succeeds with every node succeeded, each node's agent ran the
// program exactly once (counted on disk by the program itself, keyed by
// its agent's pid), and never did two of them run at once (an flock'd
// counter the program keeps).
func TestRunOnRealNodes(t *testing.T) {
	t.Parallel()
	s := startAgentStack(t)
	fleettest.StartService(t, "worker", s.db.URL, "wk_agent_runs", fleettest.FastCoord...)
	ids, creds := fleettest.RegisterNodes(t, s.db.Pool, "agrun", 3)
	nodeOfPid := map[int]string{}
	for i, id := range ids {
		p := s.startAgent(t, id, creds[i])
		nodeOfPid[p.Cmd.Process.Pid] = id
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	work := t.TempDir()

	payload, err := protojson.Marshal(&nodev1.ExecPayload{Argv: []string{"sh", "-c", windowScript, "sh", work}})
	require.NoError(t, err)
	created, err := s.api.CreateRun(ctx, authed(s.api, &controlv1.CreateRunRequest{Target: &controlv1.RunTarget{NodeIds: ids},
		Kind: "exec", Payload: payload, MaxInFlight: "1", MaxFailures: "0", CommandTimeout: durationpb.New(time.Minute)}))
	require.NoError(t, err)
	// runsStack.wait needs only the operator's client.
	run, nodes := (&runsStack{op: s.api}).wait(t, ctx, created.Msg.GetRun().GetId())

	require.Equal(t, controlv1.RunState_RUN_STATE_SUCCEEDED, run.GetState(), run.GetReason())
	require.Equal(t, map[string]int32{"succeeded": 3}, run.GetCounts())
	require.Len(t, nodes, 3)
	for _, n := range nodes {
		require.Equal(t, controlv1.RunNodeState_RUN_NODE_STATE_SUCCEEDED, n.GetState(), "node %s", n.GetNodeId())
		r := s.wait(ctx, t, n.GetCommandId())
		require.Equal(t, n.GetNodeId(), r.GetCommand().GetNodeId())
		require.Equal(t, "held\n", string(r.GetResult().GetOutput()), "node %s ran the program to its end", n.GetNodeId())
	}

	b, err := os.ReadFile(filepath.Join(work, "starts"))
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	ran := map[string]int{}
	peak := 0
	for _, line := range lines {
		var pid, inFlight int
		_, err := fmt.Sscan(line, &pid, &inFlight)
		require.NoError(t, err, "starts line %q", line)
		node, ok := nodeOfPid[pid]
		require.True(t, ok, "the program's parent %d is one of the agents %v", pid, nodeOfPid)
		ran[node]++
		peak = max(peak, inFlight)
	}
	for _, id := range ids {
		require.Equal(t, 1, ran[id], "node %s ran the program once; starts:\n%s", id, b)
	}
	require.Len(t, lines, 3, "three runs of the program in all; starts:\n%s", b)
	require.Equal(t, 1, peak, "never two at once with max_in_flight 1; starts (agent pid, running then):\n%s", b)
	left, err := os.ReadFile(filepath.Join(work, "in-flight"))
	require.NoError(t, err)
	require.Equal(t, "0", strings.TrimSpace(string(left)), "every program counted itself out")
}
