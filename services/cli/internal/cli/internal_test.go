package cli

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// TestCheckRunCount: the values the api accepts pass, the others are
// usage errors naming the flag.
func TestCheckRunCount(t *testing.T) {
	for _, c := range []struct {
		s         string
		allowZero bool
		ok        bool
	}{
		{"1", false, true}, {"50", false, true}, {"25%", false, true}, {"100%", false, true}, {"100000", false, true},
		{"0", false, false}, {"0%", false, false}, {"101%", false, false}, {"100001", false, false},
		{"", false, false}, {"-1", false, false}, {"+1", false, false}, {"1.5", false, false}, {"ten", false, false},
		{"%", false, false}, {"5%%", false, false},
		{"0", true, true}, {"0%", true, true}, {"10%", true, true}, {"150%", true, false}, {"x", true, false},
	} {
		err := checkRunCount("--max-x", c.s, c.allowZero)
		if (err == nil) != c.ok {
			t.Errorf("checkRunCount(%q, allowZero %v) = %v, want ok %v", c.s, c.allowZero, err, c.ok)
			continue
		}
		var ue *usageError
		if err != nil && (!errors.As(err, &ue) || !strings.HasPrefix(err.Error(), "--max-x ")) {
			t.Errorf("checkRunCount(%q): %v is not a usage error naming the flag", c.s, err)
		}
	}
}

// TestPrefixSink: whole lines are prefixed, a partial line waits for its
// end or for done, and the streams stay apart.
func TestPrefixSink(t *testing.T) {
	var out, errOut bytes.Buffer
	p := newPrefixSink(&out, &errOut, true)
	p.write("n1", nodev1.OutputStream_OUTPUT_STREAM_STDOUT, []byte("a\nb"))
	p.write("n2", nodev1.OutputStream_OUTPUT_STREAM_STDOUT, []byte("x\n"))
	p.write("n1", nodev1.OutputStream_OUTPUT_STREAM_STDOUT, []byte("c\nd"))
	p.write("n1", nodev1.OutputStream_OUTPUT_STREAM_STDERR, []byte("e"))
	p.done("n1")
	if got, want := out.String(), "n1: a\nn2: x\nn1: bc\nn1: d\n"; got != want {
		t.Fatalf("stdout %q, want %q", got, want)
	}
	if got, want := errOut.String(), "n1: e\n"; got != want {
		t.Fatalf("stderr %q, want %q", got, want)
	}
}

// TestCountsLine lists the non-zero counts in the order of the states.
func TestCountsLine(t *testing.T) {
	r := &controlv1.Run{Total: 3, Counts: map[string]int32{"not_started": 2, "failed": 1, "succeeded": 0}}
	if got, want := countsLine(r), "3 node(s): 1 failed, 2 not_started"; got != want {
		t.Fatalf("%q, want %q", got, want)
	}
}

// fakeRuns serves StreamRunNodes and StreamCommandOutput as the api does
// when its calls are cut: the first StreamRunNodes call ends at the 60 s
// bound, the second UNAVAILABLE, the third with the run's end; command a's
// output stream is cut once after its first line.
type fakeRuns struct {
	controlv1connect.UnimplementedControlServiceHandler
	mu          sync.Mutex
	runCalls    int
	outputCalls map[string][]int64 // command -> the offsets asked for
}

func (f *fakeRuns) StreamRunNodes(_ context.Context, _ *connect.Request[controlv1.StreamRunNodesRequest], st *connect.ServerStream[controlv1.StreamRunNodesResponse]) error {
	f.mu.Lock()
	f.runCalls++
	call := f.runCalls
	f.mu.Unlock()
	node := func(id string, s controlv1.RunNodeState, cmd string) error {
		return st.Send(&controlv1.StreamRunNodesResponse{Node: &controlv1.RunNode{NodeId: id, State: s, CommandId: cmd}})
	}
	switch call {
	case 1:
		_ = node("a", controlv1.RunNodeState_RUN_NODE_STATE_RUNNING, "cmd-a")
		_ = node("b", controlv1.RunNodeState_RUN_NODE_STATE_PENDING, "")
		return connect.NewError(connect.CodeDeadlineExceeded, errors.New("the 60 s bound"))
	case 2:
		_ = node("a", controlv1.RunNodeState_RUN_NODE_STATE_SUCCEEDED, "cmd-a")
		_ = node("b", controlv1.RunNodeState_RUN_NODE_STATE_RUNNING, "cmd-b")
		return connect.NewError(connect.CodeUnavailable, errors.New("replica stopping"))
	}
	_ = node("a", controlv1.RunNodeState_RUN_NODE_STATE_SUCCEEDED, "cmd-a")
	_ = node("b", controlv1.RunNodeState_RUN_NODE_STATE_SUCCEEDED, "cmd-b")
	return nil
}

func (f *fakeRuns) StreamCommandOutput(_ context.Context, req *connect.Request[controlv1.StreamCommandOutputRequest], st *connect.ServerStream[controlv1.StreamCommandOutputResponse]) error {
	id, off := req.Msg.GetCommandId(), req.Msg.GetOffset()
	f.mu.Lock()
	f.outputCalls[id] = append(f.outputCalls[id], off)
	f.mu.Unlock()
	out := map[string]string{"cmd-a": "a1\na2\n", "cmd-b": "b\n"}[id]
	if id == "cmd-a" && off == 0 {
		_ = st.Send(&controlv1.StreamCommandOutputResponse{Offset: 0, Data: []byte("a1\n")})
		return connect.NewError(connect.CodeUnavailable, errors.New("replica stopping"))
	}
	return st.Send(&controlv1.StreamCommandOutputResponse{Offset: off, Data: []byte(out[off:])})
}

// TestFollowRunResumes: followRun calls StreamRunNodes again when a call
// is cut, follows each command once however often its node is re-sent,
// resumes an output from its last offset, and returns once the run has
// ended and every output was read.
func TestFollowRunResumes(t *testing.T) {
	f := &fakeRuns{outputCalls: map[string][]int64{}}
	mux := http.NewServeMux()
	mux.Handle(controlv1connect.NewControlServiceHandler(f))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	s := &session{t: &target{api: srv.URL}, client: controlv1connect.NewControlServiceClient(srv.Client(), srv.URL)}
	var out, errOut bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.followRun(ctx, "run-1", newPrefixSink(&out, &errOut, true)); err != nil {
		t.Fatalf("followRun: %v (stderr %q)", err, errOut.String())
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.runCalls != 3 {
		t.Fatalf("%d StreamRunNodes calls, want 3", f.runCalls)
	}
	if got := fmt.Sprint(f.outputCalls); got != "map[cmd-a:[0 3] cmd-b:[0]]" {
		t.Fatalf("output calls %s", got)
	}
	if a, b := linesOf(out.String(), "a"), linesOf(out.String(), "b"); a != "a1\na2\n" || b != "b\n" {
		t.Fatalf("stdout %q", out.String())
	}
}

// linesOf is the lines of out prefixed "node: ", without the prefix.
func linesOf(out, node string) string {
	var b strings.Builder
	for _, l := range strings.SplitAfter(out, "\n") {
		if rest, ok := strings.CutPrefix(l, node+": "); ok {
			b.WriteString(rest)
		}
	}
	return b.String()
}

// TestExecPayloadIsStable: the same argv always encodes to the same bytes
// (protojson's spacing varies from build to build on purpose).
func TestExecPayloadIsStable(t *testing.T) {
	b, err := execPayload([]string{"sh", "-c", "echo up"})
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != `{"argv":["sh","-c","echo up"]}` {
		t.Fatalf("payload %s", b)
	}
}
