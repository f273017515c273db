package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/daemon"
	"github.com/leasehold/leasehold/pkg/fleettest"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

const runsOperatorToken = "e2e-runs-operator-token-01"

// runPayload is what the run-test handler does: sleep, then fail on the
// listed nodes; block waits for its ctx (a cancel) instead.
type runPayload struct {
	Tag     string   `json:"tag"`
	SleepMs int      `json:"sleep_ms"`
	Fail    []string `json:"fail,omitempty"`
	Block   bool     `json:"block,omitempty"`
}

// execution is one handler run seen by a node.
type execution struct {
	node       string
	start, end time.Time
	failed     bool
	stopped    bool // its ctx was cancelled
}

// runNodes are in-process daemons that record, per payload tag, every
// execution and the most that ran at once: the window and exactly-once
// are checked from the nodes' side.
type runNodes struct {
	mu       sync.Mutex
	execs    map[string][]execution
	inFlight map[string]int
	maxIn    map[string]int
	started  chan string // node ids as blocking handlers start (buffered)
}

func (r *runNodes) handle(ctx context.Context, node string, c *nodev1.Command) daemon.Outcome {
	var p runPayload
	if c.GetKind() != "e2e.run" || json.Unmarshal(c.GetPayload(), &p) != nil {
		return daemon.Outcome{ExitCode: 2, Err: "unknown kind"}
	}
	r.mu.Lock()
	r.inFlight[p.Tag]++
	r.maxIn[p.Tag] = max(r.maxIn[p.Tag], r.inFlight[p.Tag])
	e := execution{node: node, start: time.Now()}
	r.mu.Unlock()
	if p.Block {
		select {
		case r.started <- node:
		default:
		}
		<-ctx.Done()
		e.stopped = true
	} else {
		select {
		case <-time.After(time.Duration(p.SleepMs) * time.Millisecond):
		case <-ctx.Done():
			e.stopped = true
		}
	}
	e.failed = slices.Contains(p.Fail, node)
	r.mu.Lock()
	e.end = time.Now()
	r.inFlight[p.Tag]--
	r.execs[p.Tag] = append(r.execs[p.Tag], e)
	r.mu.Unlock()
	if e.failed {
		return daemon.Outcome{ExitCode: 1, Err: "failed on purpose"}
	}
	if e.stopped {
		return daemon.Outcome{ExitCode: 130, Err: "cancelled"}
	}
	return daemon.Outcome{Output: []byte("ok")}
}

func (r *runNodes) snapshot(tag string) ([]execution, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.execs[tag]), r.maxIn[tag]
}

// runsStack is two gateways behind a fail-over balancer, an api and two
// workers on one database, with n in-process nodes connected through the
// balancer (to the first gateway while it lives).
type runsStack struct {
	db      *pgtest.DB
	ids     []string
	nodes   *runNodes
	op      controlClient
	workers map[string]*proctest.Proc
	// gateways: nodes dial the first through a balancer that fails over to
	// the second.
	gateways []fleettest.Gateway
}

func startRunsStack(t *testing.T, n int) *runsStack {
	t.Helper()
	db := pgtest.NewDB(t)
	ids, creds := fleettest.RegisterNodes(t, db.Pool, "rn", n)
	gw1 := fleettest.StartGateway(t, db.URL, "gw_runs_1", fleettest.FastGateway...)
	gw2 := fleettest.StartGateway(t, db.URL, "gw_runs_2", fleettest.FastGateway...)
	lb := balancer(t, gw1.Listen, gw2.Listen)
	apiAddr := fleettest.Addr(t)
	args := append([]string{"--database-url", db.URL, "--http-addr", fleettest.Addr(t), "--id", "api_runs", "--log-format", "text",
		"--listen-addr", apiAddr, "--api.wait-poll-interval", "100ms"}, fleettest.DBFlags(db.URL)...)
	api := proctest.Start(t, "api_runs", fleettest.Binary(t, "api"), []string{"LEASEHOLD_API_TOKENS=operator:" + runsOperatorToken}, args...)
	api.WaitReady(60 * time.Second)
	s := &runsStack{db: db, ids: ids, workers: map[string]*proctest.Proc{}, gateways: []fleettest.Gateway{gw1, gw2},
		op:    controlClient{controlv1connect.NewControlServiceClient(http.DefaultClient, "http://"+apiAddr), runsOperatorToken},
		nodes: &runNodes{execs: map[string][]execution{}, inFlight: map[string]int{}, maxIn: map[string]int{}, started: make(chan string, 4*n)}}
	for _, w := range []string{"wk_runs_a", "wk_runs_b"} {
		s.workers[w] = fleettest.StartService(t, "worker", db.URL, w, fleettest.FastCoord...)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for i, id := range ids {
		d, err := daemon.New(daemon.Config{Address: lb.URL(), NodeID: id, Credential: creds[i],
			BackoffBase: 50 * time.Millisecond, BackoffMax: 500 * time.Millisecond,
			Handler: func(ctx context.Context, c *nodev1.Command) daemon.Outcome { return s.nodes.handle(ctx, id, c) }})
		require.NoError(t, err)
		wg.Go(func() { _ = d.Run(ctx) })
	}
	t.Cleanup(func() { cancel(); wg.Wait() })
	require.Eventually(t, func() bool {
		c, err := queryInt(db.Pool, `SELECT count(*) FROM node_sessions WHERE state = 'connected'`)
		return err == nil && c == n
	}, time.Minute, 50*time.Millisecond, "every node connects")
	return s
}

func (s *runsStack) create(t *testing.T, ctx context.Context, nodes []string, p runPayload, inFlight, failures string) string {
	t.Helper()
	payload, err := json.Marshal(p)
	require.NoError(t, err)
	r, err := s.op.CreateRun(ctx, authed(s.op, &controlv1.CreateRunRequest{Target: &controlv1.RunTarget{NodeIds: nodes},
		Kind: "e2e.run", Payload: payload, MaxInFlight: inFlight, MaxFailures: failures, CommandTimeout: durationpb.New(time.Minute)}))
	require.NoError(t, err)
	return r.Msg.GetRun().GetId()
}

// wait waits for the run to be terminal and every node settled.
func (s *runsStack) wait(t *testing.T, ctx context.Context, id string) (*controlv1.Run, []*controlv1.RunNode) {
	t.Helper()
	for {
		w, err := s.op.WaitRun(ctx, authed(s.op, &controlv1.WaitRunRequest{RunId: id, Timeout: durationpb.New(10 * time.Second)}))
		require.NoError(t, err)
		if w.Msg.GetRun().GetState() != controlv1.RunState_RUN_STATE_RUNNING &&
			w.Msg.GetRun().GetCounts()["running"] == 0 && w.Msg.GetRun().GetCounts()["pending"] == 0 {
			break
		}
		require.NoError(t, ctx.Err())
		time.Sleep(100 * time.Millisecond) // a settling cancelled run: WaitRun returns at once
	}
	g, err := s.op.GetRun(ctx, authed(s.op, &controlv1.GetRunRequest{RunId: id}))
	require.NoError(t, err)
	return g.Msg.GetRun(), g.Msg.GetNodes()
}

// requireOncePerNode checks that the nodes executed the tagged command
// exactly once each on want, and nowhere else.
func requireOncePerNode(t *testing.T, execs []execution, want []string) {
	t.Helper()
	per := map[string]int{}
	for _, e := range execs {
		per[e.node]++
	}
	for _, n := range want {
		require.Equal(t, 1, per[n], "node %s executions", n)
	}
	require.Len(t, per, len(want))
}

// TestRuns runs runs over in-process nodes connected to a real gateway,
// driven by two real worker processes: the window holds from the nodes'
// side, every node runs once, the failure budget stops new starts,
// CancelRun stops the running handlers, and a run whose gateway or worker
// is SIGKILLed mid-run completes with every node once.
func TestRuns(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a gateway, an api, two workers and 50 nodes")
	}
	t.Parallel()
	s := startRunsStack(t, 50)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	t.Run("window of 5 over 50 nodes", func(t *testing.T) {
		id := s.create(t, ctx, s.ids, runPayload{Tag: "window", SleepMs: 150}, "5", "0")
		run, nodes := s.wait(t, ctx, id)
		require.Equal(t, controlv1.RunState_RUN_STATE_SUCCEEDED, run.GetState(), run.GetReason())
		require.Equal(t, map[string]int32{"succeeded": 50}, run.GetCounts())
		execs, maxIn := s.nodes.snapshot("window")
		requireOncePerNode(t, execs, s.ids)
		require.LessOrEqual(t, maxIn, 5, "never more than max_in_flight at once, counted on the nodes")
		require.GreaterOrEqual(t, maxIn, 2, "the window was used")
		for _, n := range nodes {
			require.NotEmpty(t, n.GetCommandId())
			require.NotNil(t, n.GetFinishedAt())
		}
		n, err := queryInt(s.db.Pool, `SELECT count(*) FROM commands WHERE idempotency_key LIKE 'run:' || $1 || ':%'`, id)
		require.NoError(t, err)
		require.Equal(t, 50, n, "one command per node")
	})

	t.Run("failure budget", func(t *testing.T) {
		target := s.ids[:20]
		sorted := slices.Sorted(slices.Values(target))
		failing := sorted[:5] // nodes start in id order
		id := s.create(t, ctx, target, runPayload{Tag: "budget", SleepMs: 50, Fail: failing}, "2", "2")
		run, nodes := s.wait(t, ctx, id)
		require.Equal(t, controlv1.RunState_RUN_STATE_FAILED, run.GetState())
		require.Contains(t, run.GetReason(), "more than max_failures 2")
		execs, maxIn := s.nodes.snapshot("budget")
		require.LessOrEqual(t, maxIn, 2)
		// No node started after the run failed (both times from the
		// database's clock).
		late, err := queryInt(s.db.Pool, `SELECT count(*) FROM run_nodes rn JOIN runs r ON r.id = rn.run_id
 WHERE rn.run_id = $1 AND rn.started_at > r.finished_at`, id)
		require.NoError(t, err)
		require.Zero(t, late, "a node started after the budget was spent")
		failedOnNodes := 0
		for _, e := range execs {
			if e.failed {
				failedOnNodes++
			}
		}
		require.GreaterOrEqual(t, failedOnNodes, 3, "max_failures+1 failures on the nodes")
		ran := map[string]bool{}
		for _, e := range execs {
			ran[e.node] = true
		}
		notStarted := 0
		for _, n := range nodes {
			switch n.GetState() {
			case controlv1.RunNodeState_RUN_NODE_STATE_NOT_STARTED:
				notStarted++
				require.False(t, ran[n.GetNodeId()], "a NOT_STARTED node never ran")
			default:
				require.True(t, ran[n.GetNodeId()], "node %s is %s but never ran", n.GetNodeId(), n.GetState())
			}
		}
		require.Equal(t, 20-len(execs), notStarted)
		// The five failing nodes come first; with two in flight no
		// succeeding node can start before three failures are recorded.
		require.GreaterOrEqual(t, notStarted, 15, "the rest were not started")
	})

	t.Run("cancel mid-run", func(t *testing.T) {
		target := s.ids[20:30]
		id := s.create(t, ctx, target, runPayload{Tag: "cancel", Block: true}, "3", "0")
		for range 3 {
			select {
			case <-s.nodes.started:
			case <-ctx.Done():
				t.Fatal("the first three nodes did not start")
			}
		}
		c, err := s.op.CancelRun(ctx, authed(s.op, &controlv1.CancelRunRequest{RunId: id, Reason: "e2e"}))
		require.NoError(t, err)
		require.Equal(t, controlv1.RunState_RUN_STATE_CANCELLED, c.Msg.GetRun().GetState())
		run, nodes := s.wait(t, ctx, id)
		require.Equal(t, map[string]int32{"cancelled": 3, "not_started": 7}, run.GetCounts())
		require.Eventually(t, func() bool { execs, _ := s.nodes.snapshot("cancel"); return len(execs) == 3 }, time.Minute, 20*time.Millisecond,
			"the three running handlers end")
		execs, _ := s.nodes.snapshot("cancel")
		for _, e := range execs {
			require.True(t, e.stopped, "node %s's handler was cancelled", e.node)
		}
		require.Len(t, nodes, 10)
	})

	t.Run("gateway SIGKILL mid-run", func(t *testing.T) {
		id := s.create(t, ctx, s.ids, runPayload{Tag: "gateway", SleepMs: 100}, "5", "0")
		require.Eventually(t, func() bool { execs, _ := s.nodes.snapshot("gateway"); return len(execs) >= 8 },
			time.Minute, 10*time.Millisecond, "the run is under way")
		s.gateways[0].Kill()
		done, _ := s.nodes.snapshot("gateway")
		require.Less(t, len(done), 50, "killed mid-run")
		run, _ := s.wait(t, ctx, id)
		require.Equal(t, controlv1.RunState_RUN_STATE_SUCCEEDED, run.GetState(), run.GetReason())
		execs, maxIn := s.nodes.snapshot("gateway")
		requireOncePerNode(t, execs, s.ids)
		require.LessOrEqual(t, maxIn, 5)
		n, err := queryInt(s.db.Pool, `SELECT count(*) FROM node_sessions WHERE state = 'connected' AND gateway_id = 'gw_runs_2'`)
		require.NoError(t, err)
		require.Equal(t, 50, n, "every node moved to the other gateway")
		t.Logf("killed the gateway after %d of 50 nodes; the run completed through the other", len(done))
	})

	t.Run("worker SIGKILL mid-run", func(t *testing.T) {
		id := s.create(t, ctx, s.ids, runPayload{Tag: "kill", SleepMs: 100}, "4", "0")
		shard := fmt.Sprintf("shard:%d", coord.ShardOf(id))
		var holder string
		require.Eventually(t, func() bool {
			execs, _ := s.nodes.snapshot("kill")
			if len(execs) < 8 {
				return false
			}
			r, err := s.op.ListLeases(ctx, authed(s.op, &controlv1.ListLeasesRequest{NamePrefix: shard}))
			if err != nil {
				return false
			}
			for _, l := range r.Msg.GetLeases() {
				if l.GetName() == shard && !l.GetExpired() {
					holder = l.GetOwner()
				}
			}
			return s.workers[holder] != nil
		}, time.Minute, 10*time.Millisecond, "the run is under way on a known worker")
		s.workers[holder].Kill()
		done, _ := s.nodes.snapshot("kill")
		require.Less(t, len(done), 50, "killed mid-run")
		run, _ := s.wait(t, ctx, id)
		require.Equal(t, controlv1.RunState_RUN_STATE_SUCCEEDED, run.GetState(), run.GetReason())
		execs, maxIn := s.nodes.snapshot("kill")
		requireOncePerNode(t, execs, s.ids)
		require.LessOrEqual(t, maxIn, 4)
		t.Logf("killed %s after %d of 50 nodes; the run completed on the other worker", holder, len(done))
	})
}
