package gateway

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1/nodev1connect"
	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// Admission that refused dials cannot spend: a flood of Hellos with bad
// credentials must not change how a herd of good ones is admitted.
//
// The tests look at the schedule the gateway hands out, not at the clock:
// the bucket refills one token per 1,000 s, so over a test it holds what
// the dials before left it, and every token a bad Hello took would show as
// a good Hello pushed back, however slow the machine.

// floodRate is a bucket rate no test lasts long enough to see refill.
const floodRate = 0.001

// answerHello says h on a fresh connection (as a daemon dials) and returns
// how the gateway answered: "welcomed", "pushback <reason>", or the code
// the stream ended with. Safe from any goroutine.
func answerHello(addr string, h *nodev1.Hello) string {
	return answer(addr, &nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Hello{Hello: h}})
}

// answer is answerHello for any first message.
func answer(addr string, first *nodev1.ConnectRequest) string {
	hc := h2cClient()
	defer hc.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stream := nodev1connect.NewNodeGatewayServiceClient(hc, "http://"+addr).Connect(ctx)
	defer func() { _ = stream.CloseRequest(); _ = stream.CloseResponse() }()
	// A refused stream may end before the Send: Receive has its error.
	if err := stream.Send(first); err != nil && !errors.Is(err, io.EOF) {
		return "send: " + err.Error()
	}
	m, err := stream.Receive()
	switch {
	case err != nil:
		return connect.CodeOf(err).String()
	case m.GetWelcome() != nil:
		return "welcomed"
	case m.GetPushback() != nil:
		return "pushback " + m.GetPushback().GetReason()
	default:
		return fmt.Sprintf("unexpected %v", m)
	}
}

// herdAnswers dials every node of ids at once, each once, and counts the
// answers: the herd's admission schedule.
func herdAnswers(addr string, ids, creds []string) map[string]int {
	answers := make([]string, len(ids))
	var wg sync.WaitGroup
	for i := range ids {
		wg.Go(func() {
			answers[i] = answerHello(addr, &nodev1.Hello{NodeId: ids[i], Credential: creds[i], Kind: nodev1.NodeKind_NODE_KIND_NODE})
		})
	}
	wg.Wait()
	return countAnswers(answers)
}

func countAnswers(answers []string) map[string]int {
	n := map[string]int{}
	for _, a := range answers {
		n[a]++
	}
	return n
}

// badHello is the i-th Hello of a flood aimed at the nodes ids: a wrong
// credential for one of them, a credential for a node that does not exist,
// a credential that is not shaped like one, and one without the prefix.
func badHello(ids []string, i int) *nodev1.Hello {
	wrong := fmt.Sprintf("%s%043d", nodeauth.Prefix, i) // shaped like a credential
	h := &nodev1.Hello{NodeId: ids[i%len(ids)], Credential: wrong, Kind: nodev1.NodeKind_NODE_KIND_NODE}
	switch i % 4 {
	case 1:
		h.NodeId = fmt.Sprintf("nobody-%d", i)
	case 2:
		h.Credential = nodeauth.Prefix + "short"
	case 3:
		h.Credential = "not-a-credential-" + wrong
	}
	return h
}

// floodBadHellos sends n bad Hellos from `workers` goroutines, each waiting
// for its answer, and counts the answers.
func floodBadHellos(addr string, ids []string, n, workers int) map[string]int {
	hellos := make([]*nodev1.Hello, n)
	for i := range hellos {
		hellos[i] = badHello(ids, i)
	}
	answers := make([]string, n)
	var next atomic.Int64
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := int(next.Add(1) - 1); i < n; i = int(next.Add(1) - 1) {
				answers[i] = answerHello(addr, hellos[i])
			}
		})
	}
	wg.Wait()
	return countAnswers(answers)
}

func herdIDs(prefix string, n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = creds2id(prefix, i)
	}
	return ids
}

// TestBadHelloFloodThenHerd: a herd is admitted; a flood of Hellos with bad
// credentials follows (wrong credentials for the herd's own nodes, unknown
// nodes, malformed credentials); then the same herd dials again and must
// get the same schedule as the first time: every node welcomed at its first
// dial, no pushback. Before authentication came ahead of the bucket, the
// flood took the tokens the herd needed and every node of the second herd
// was pushed back.
func TestBadHelloFloodThenHerd(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	const n, floodN = 16, 64
	cfg := testConfig()
	// Room for the herd twice and nothing more.
	cfg.HelloRate, cfg.HelloBurst = floodRate, 2*n
	g := startGateway(t, db, cfg)
	ids, creds := herdIDs("herd", n), registerNodes(t, db, "herd", n)

	quiet := herdAnswers(g.Addr(), ids, creds)
	require.Equal(t, map[string]int{"welcomed": n}, quiet, "without a flood the herd is welcomed at its first dials")
	tokens := g.limiter.Tokens()
	require.InDelta(t, float64(n), tokens, 0.5, "the herd took one token a node")

	flood := floodBadHellos(g.Addr(), ids, floodN, 8)
	afterFlood := g.limiter.Tokens()

	again := herdAnswers(g.Addr(), ids, creds)
	require.Equal(t, quiet, again, "after %d bad Hellos (answered %v) the herd is admitted as without them", floodN, flood)
	require.InDelta(t, tokens, afterFlood, 0.5, "the flood took no token of the bucket")
	require.Equal(t, map[string]int{connect.CodeUnauthenticated.String(): floodN}, flood, "every bad Hello refused UNAUTHENTICATED, none pushed back")
	require.Zero(t, testutil.ToFloat64(g.m.pushbacks.WithLabelValues("hello-rate")))
	require.InDelta(t, 2*n, testutil.ToFloat64(g.m.hellos.WithLabelValues("welcomed")), 0)
}

// TestBadHelloFloodBesideHerd: a herd dials while a flood of bad Hellos is
// under way, the flood's dials waiting their turn for a credential check
// beside the herd's: every node of the herd is still welcomed at its first
// dial, and the flood got no token.
func TestBadHelloFloodBesideHerd(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	const n = 16
	cfg := testConfig()
	// Room for the herd and nothing more.
	cfg.HelloRate, cfg.HelloBurst = floodRate, n
	g := startGateway(t, db, cfg)
	ids, creds := herdIDs("beside", n), registerNodes(t, db, "beside", n)

	stop := make(chan struct{})
	var (
		answered atomic.Int64
		mu       sync.Mutex
		flood    = map[string]int{}
		wg       sync.WaitGroup
	)
	for w := range 8 {
		wg.Go(func() {
			for i := w; ; i += 8 {
				select {
				case <-stop:
					return
				default:
				}
				a := answerHello(g.Addr(), badHello(ids, i))
				mu.Lock()
				flood[a]++
				mu.Unlock()
				answered.Add(1)
			}
		})
	}
	// The flood is under way (more bad Hellos answered than the bucket
	// holds) before the herd dials.
	require.Eventually(t, func() bool { return answered.Load() >= 2*n }, time.Minute, 5*time.Millisecond)
	herd := herdAnswers(g.Addr(), ids, creds)
	close(stop)
	wg.Wait()
	require.Equal(t, map[string]int{"welcomed": n}, herd, "the herd is welcomed at its first dials beside the flood (answered %v)", flood)
	require.Zero(t, testutil.ToFloat64(g.m.pushbacks.WithLabelValues("hello-rate")))
	require.InDelta(t, 0, g.limiter.Tokens(), 0.5, "the herd took the burst, the flood nothing")
}

// TestHelloRefusalsByReason: each way a Hello is refused for good is
// counted under its reason, and none of them takes a token of the bucket.
func TestHelloRefusalsByReason(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	cfg := testConfig()
	cfg.HelloRate, cfg.HelloBurst = floodRate, 1
	g := startGateway(t, db, cfg)
	creds := registerNodes(t, db, "why", 1)
	wrong := fmt.Sprintf("%s%043d", nodeauth.Prefix, 7)
	node := nodev1.NodeKind_NODE_KIND_NODE
	for _, c := range []struct {
		first  *nodev1.ConnectRequest
		reason string
		want   connect.Code
	}{
		{&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Heartbeat{Heartbeat: &nodev1.Heartbeat{}}}, "no-hello", connect.CodeInvalidArgument},
		{helloMsg(&nodev1.Hello{NodeId: "bad id", Credential: creds[0], Kind: node}), "invalid", connect.CodeInvalidArgument},
		{helloMsg(&nodev1.Hello{NodeId: "why-0", Credential: "lhn_short", Kind: node}), "credential-malformed", connect.CodeUnauthenticated},
		{helloMsg(&nodev1.Hello{NodeId: "why-0", Credential: wrong, Kind: node}), "unauthenticated", connect.CodeUnauthenticated},
		{helloMsg(&nodev1.Hello{NodeId: "nobody", Credential: creds[0], Kind: node}), "unauthenticated", connect.CodeUnauthenticated},
		{helloMsg(&nodev1.Hello{NodeId: "why-0", Credential: creds[0], Kind: nodev1.NodeKind_NODE_KIND_SITE_AGENT}), "registration", connect.CodePermissionDenied},
	} {
		before := testutil.ToFloat64(g.m.helloRefusals.WithLabelValues(c.reason))
		require.Equal(t, c.want.String(), answer(g.Addr(), c.first), c.reason)
		require.Equal(t, before+1, testutil.ToFloat64(g.m.helloRefusals.WithLabelValues(c.reason)), c.reason)
	}
	require.InDelta(t, 1, g.limiter.Tokens(), 0.01, "no refused Hello took the one token")
	require.Equal(t, "welcomed", answerHello(g.Addr(), &nodev1.Hello{NodeId: "why-0", Credential: creds[0], Kind: node}))
}

func helloMsg(h *nodev1.Hello) *nodev1.ConnectRequest {
	return &nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Hello{Hello: h}}
}
