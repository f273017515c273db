package cli

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/durationpb"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/selector"
)

// interruptReason is the reason CancelRun records on Ctrl-C.
const interruptReason = "interrupted from the CLI"

// cancelDrain bounds how long run keeps printing after Ctrl-C cancelled
// the run, waiting for it to end.
const cancelDrain = time.Minute

func (a *app) runCommand() *cobra.Command {
	var selectorFlag, maxInFlight, maxFailures string
	var timeout, pause time.Duration
	cmd := &cobra.Command{
		Use:   "run NODE... [-l SELECTOR] [--max-in-flight N|P%] [--max-failures N|P%] [--timeout D] [--pause D] -- ARGV...",
		Short: "Run a program on nodes (one server-side run) and stream its output",
		Long: `Run ARGV (no shell: wrap it in sh -c '...' for one) as an exec command on
the named nodes and/or the nodes matching -l (both given: the named nodes that
match), as one run (CreateRun): the api records the node set, and the workers
start the command on at most --max-in-flight nodes at a time (a sliding window:
as one node finishes, the next starts) and stop starting nodes once more than
--max-failures have failed. Cordoned nodes are skipped.

Output streams live as the nodes write it, each line prefixed by "NODE: " when
the run has several nodes (stdout to stdout, stderr to stderr); a summary
follows on stderr.

Exit status: 0 when the run succeeded, 1 otherwise, 130 on Ctrl-C, which
cancels the run (CancelRun) and prints until it has ended (Ctrl-C again exits
at once).

The run is driven by the server: if this client dies, the run goes on;
leasehold runs get RUN shows it, leasehold runs cancel RUN stops it.`,
		Example: `  leasehold run node-1 -- uname -a
  leasehold run -l 'rack in (r1,r2),!canary' --max-in-flight 10 -- systemctl restart app
  leasehold run -l role=web --max-in-flight 25% --max-failures 1 --pause 30s -- /opt/app/upgrade`,
		ValidArgsFunction: a.completeNodes,
		RunE: func(cmd *cobra.Command, args []string) error {
			dash := cmd.ArgsLenAtDash()
			if dash < 0 || dash == len(args) {
				return usagef("no program: put it after --, e.g. leasehold run node-1 -- uname -a")
			}
			nodes, argv := dedupe(args[:dash]), args[dash:]
			if _, err := selector.Parse(selectorFlag); err != nil {
				return usagef("-l: selector %q: %v", selectorFlag, err)
			}
			if len(nodes) == 0 && strings.TrimSpace(selectorFlag) == "" {
				return usagef("no node: name nodes or select them with -l")
			}
			if err := checkRunCount("--max-in-flight", maxInFlight, false); err != nil {
				return err
			}
			if err := checkRunCount("--max-failures", maxFailures, true); err != nil {
				return err
			}
			if timeout != 0 && (timeout < time.Second || timeout > 7*24*time.Hour) {
				return usagef("--timeout %s: must be between 1s and 168h (or 0 for the api's default)", timeout)
			}
			if pause < 0 || pause > time.Hour {
				return usagef("--pause %s: must be between 0 and 1h", pause)
			}
			for _, arg := range argv {
				if strings.ContainsRune(arg, 0) {
					return usagef("the program's arguments must not contain NUL")
				}
			}
			payload, err := execPayload(argv)
			if err != nil {
				return err
			}
			s, err := a.dial()
			if err != nil {
				return err
			}
			req := &controlv1.CreateRunRequest{
				Target:      &controlv1.RunTarget{NodeIds: nodes, Selector: selectorFlag},
				Kind:        "exec",
				Payload:     payload,
				MaxInFlight: maxInFlight, MaxFailures: maxFailures,
				// One key per invocation: a create retried after a lost
				// answer returns the same run.
				IdempotencyKey: newRunKey(),
			}
			if timeout > 0 {
				req.CommandTimeout = durationpb.New(timeout)
			}
			if pause > 0 {
				req.BatchPause = durationpb.New(pause)
			}
			return a.runOnServer(cmd.Context(), s, req, nodes, timeout)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&selectorFlag, "selector", "l", "", "run on the nodes matching this label selector (k=v, k!=v, 'k in (a,b)', 'k notin (a,b)', k, !k; applied by the api)")
	f.DurationVar(&timeout, "timeout", 0, "each node's command timeout, 1s..168h (0: the api's default, 1h)")
	f.StringVar(&maxInFlight, "max-in-flight", "50", "how many nodes run the command at once: a number, or a percentage of the nodes (25%)")
	f.StringVar(&maxFailures, "max-failures", "0", "how many nodes may fail before no new node is started: a number or a percentage (0: the first failure stops new starts)")
	f.DurationVar(&pause, "pause", 0, "wait this long after a node finishes before the next starts (0..1h)")
	return cmd
}

// checkRunCount validates a --max-in-flight or --max-failures value as the
// api does: a number or a percentage, at most 100%, zero only when
// allowZero.
func checkRunCount(flag, s string, allowZero bool) error {
	num, pct := strings.CutSuffix(s, "%")
	n, err := strconv.Atoi(num)
	if err != nil || num == "" || num[0] == '+' || num[0] == '-' || n < 0 {
		return usagef("%s %q: want a number or a percentage of the nodes, e.g. 10 or 25%%", flag, s)
	}
	if n == 0 && !allowZero {
		return usagef("%s %q: must be at least 1 (or 1%%)", flag, s)
	}
	if pct && n > 100 {
		return usagef("%s %q: a percentage must be at most 100%%", flag, s)
	}
	if !pct && n > 100000 {
		return usagef("%s %q: must be at most 100000", flag, s)
	}
	return nil
}

// newRunKey is a fresh idempotency key for one invocation of run.
func newRunKey() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return "leasehold-run-" + hex.EncodeToString(b[:])
}

// runOnServer creates the run, follows it until it has ended and prints
// its summary. The first SIGINT or SIGTERM cancels the run and keeps
// printing until it has ended (at most cancelDrain); a second exits at
// once.
func (a *app) runOnServer(parent context.Context, s *session, req *controlv1.CreateRunRequest, named []string, timeout time.Duration) error {
	// The root context ends on the first signal; this command handles
	// signals itself, so it works on a context of its own.
	ctx, stopWork := context.WithCancel(context.WithoutCancel(parent))
	defer stopWork()
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sigs)

	var created *connect.Response[controlv1.CreateRunResponse]
	var err error
	for attempt := 0; ; attempt++ {
		created, err = s.client.CreateRun(ctx, connect.NewRequest(req))
		if err == nil || connect.CodeOf(err) != connect.CodeUnavailable || attempt == 2 {
			break
		}
		select {
		case <-sigs:
			return &exitError{code: exitInterrupted, msg: "interrupted before the run was created"}
		case <-time.After(time.Duration(attempt+1) * 300 * time.Millisecond): // back-off of a retried create
		}
	}
	if err != nil {
		if connect.CodeOf(err) == connect.CodeFailedPrecondition && req.GetTarget().GetSelector() != "" {
			return withHint(s.explain(err), "leasehold nodes ls -l '"+req.GetTarget().GetSelector()+"' shows which nodes the selector matches")
		}
		return s.explain(err)
	}
	run := created.Msg.GetRun()
	several := run.GetTotal() > 1
	if several {
		_, _ = fmt.Fprintf(a.stderr, "leasehold: run %s: %d nodes, at most %d at once, failure budget %d\n",
			run.GetId(), run.GetTotal(), run.GetMaxInFlight(), run.GetMaxFailures())
	} else {
		a.debugf("run %s", run.GetId())
	}
	if len(named) > 0 {
		a.warnNotConnected(ctx, s, named, timeout)
	}

	var mu sync.Mutex
	interrupted := false
	go func() {
		select {
		case <-sigs:
		case <-ctx.Done():
			return
		}
		mu.Lock()
		interrupted = true
		mu.Unlock()
		_, _ = fmt.Fprintf(a.stderr, "leasehold: interrupted: cancelling run %s (Ctrl-C again to exit at once)\n", run.GetId())
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_, err := s.client.CancelRun(cctx, connect.NewRequest(&controlv1.CancelRunRequest{RunId: run.GetId(), Reason: interruptReason}))
		cancel()
		if err != nil && ctx.Err() == nil {
			_, _ = fmt.Fprintf(a.stderr, "leasehold: cancel run %s: %s\n", run.GetId(), errorLine(err))
		}
		timer := time.NewTimer(cancelDrain)
		defer timer.Stop()
		select {
		case <-sigs:
		case <-timer.C:
		case <-ctx.Done():
		}
		stopWork()
	}()
	wasInterrupted := func() bool {
		mu.Lock()
		defer mu.Unlock()
		return interrupted
	}

	sink := newPrefixSink(a.stdout, a.stderr, several)
	err = s.followRun(ctx, run.GetId(), sink)
	if ctx.Err() != nil {
		return &exitError{code: exitInterrupted, msg: fmt.Sprintf("interrupted: run %s cancelled; leasehold runs get %s shows it", run.GetId(), run.GetId())}
	}
	if err != nil {
		return fmt.Errorf("follow run %s: %w", run.GetId(), err)
	}
	res, err := s.client.GetRun(ctx, connect.NewRequest(&controlv1.GetRunRequest{RunId: run.GetId()}))
	if err != nil {
		return s.explain(err)
	}
	run, nodeList := res.Msg.GetRun(), res.Msg.GetNodes()
	if several {
		a.printRunSummary(run, nodeList)
	}
	if wasInterrupted() {
		return &exitError{code: exitInterrupted, msg: fmt.Sprintf("interrupted: run %s %s", run.GetId(), runState(run.GetState()))}
	}
	if run.GetState() == controlv1.RunState_RUN_STATE_SUCCEEDED {
		return nil
	}
	if !several && len(nodeList) == 1 {
		return &exitError{code: exitFailed, msg: fmt.Sprintf("%s: %s", nodeList[0].GetNodeId(), describeRunNode(nodeList[0]))}
	}
	if !several {
		return &exitError{code: exitFailed, msg: fmt.Sprintf("run %s %s: %s", run.GetId(), runState(run.GetState()), run.GetReason())}
	}
	return &exitError{code: exitFailed}
}

// followRun follows a run's nodes (StreamRunNodes, called again when a
// call ends at its 60 s bound or is cut) and, for each node given a
// command, that command's output to sink. It returns once the run has
// ended and every output has been read to its end.
func (s *session) followRun(ctx context.Context, runID string, sink outputSink) error {
	var wg sync.WaitGroup
	defer wg.Wait()
	followed := map[string]bool{} // command ids
	follow := func(n *controlv1.RunNode) {
		id := n.GetCommandId()
		if id == "" || followed[id] {
			return
		}
		followed[id] = true
		node := n.GetNodeId()
		wg.Go(func() {
			end, truncated, err := s.streamOutput(ctx, id, 0, -1, func(st nodev1.OutputStream, b []byte) { sink.write(node, st, b) })
			sink.done(node)
			switch {
			case err != nil && ctx.Err() == nil:
				sink.write(node, nodev1.OutputStream_OUTPUT_STREAM_STDERR, []byte("leasehold: output of command "+id+": "+errorLine(err)+"\n"))
			case truncated:
				sink.write(node, nodev1.OutputStream_OUTPUT_STREAM_STDERR, []byte("("+notKept(end)+")\n"))
			}
			sink.done(node)
		})
	}
	retries := 0
	for {
		opened := time.Now()
		st, err := s.client.StreamRunNodes(ctx, connect.NewRequest(&controlv1.StreamRunNodesRequest{RunId: runID}))
		if err != nil {
			return s.explain(err)
		}
		for st.Receive() {
			follow(st.Msg().GetNode())
			retries = 0
		}
		err = st.Err()
		_ = st.Close()
		if err == nil {
			return nil // the run has ended
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		switch code := connect.CodeOf(err); {
		case code == connect.CodeDeadlineExceeded:
			if time.Since(opened) < time.Second { // not the 60 s bound: do not spin
				time.Sleep(500 * time.Millisecond)
			}
		case code == connect.CodeUnavailable && retries < 5:
			retries++
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(time.Duration(retries) * 200 * time.Millisecond): // back-off before calling again
			}
		default:
			return s.explain(err)
		}
	}
}

// warnNotConnected says which named nodes are not connected: their
// commands wait, pending, until the node connects or the timeout passes.
func (a *app) warnNotConnected(ctx context.Context, s *session, named []string, timeout time.Duration) {
	all, err := s.listNodes(ctx, &controlv1.ListNodesRequest{}, selector.Selector{})
	if err != nil {
		return // the run says what is wrong
	}
	state := map[string]controlv1.NodeState{}
	for _, n := range all {
		state[n.GetId()] = n.GetState()
	}
	wait := "the api's default timeout"
	if timeout > 0 {
		wait = timeout.String()
	}
	for _, id := range named {
		if st, ok := state[id]; ok && st != controlv1.NodeState_NODE_STATE_CONNECTED && st != controlv1.NodeState_NODE_STATE_REVOKED {
			_, _ = fmt.Fprintf(a.stderr, "leasehold: warning: node %s is %s: its command waits until it connects, at most %s\n", id, nodeState(st), wait)
		}
	}
}

func dedupe(list []string) []string {
	seen := map[string]bool{}
	out := list[:0:0]
	for _, s := range list {
		if !seen[s] {
			seen[s] = true
			out = append(out, s)
		}
	}
	return out
}

func runState(s controlv1.RunState) string { return enumName(s.String(), "RUN_STATE_") }

func runNodeState(s controlv1.RunNodeState) string { return enumName(s.String(), "RUN_NODE_STATE_") }

func terminalRun(s controlv1.RunState) bool {
	return s != controlv1.RunState_RUN_STATE_RUNNING && s != controlv1.RunState_RUN_STATE_UNSPECIFIED
}

// describeRunNode is one node's result as the summary shows it.
func describeRunNode(n *controlv1.RunNode) string {
	st := runNodeState(n.GetState())
	switch {
	case n.GetState() == controlv1.RunNodeState_RUN_NODE_STATE_SUCCEEDED,
		n.GetState() == controlv1.RunNodeState_RUN_NODE_STATE_NOT_STARTED: // the run's reason says why
		return st
	case n.GetState() == controlv1.RunNodeState_RUN_NODE_STATE_FAILED && n.GetError() == "":
		return fmt.Sprintf("failed: exit code %d", n.GetExitCode())
	case n.GetError() != "":
		return st + ": " + oneLine(n.GetError())
	}
	return st
}

// nodeCounts is a run's non-zero node counts, in the order of the node
// states, each as format applied to the state's name and the count.
func nodeCounts(r *controlv1.Run, format func(state string, n int32) string) []string {
	var parts []string
	for v := int32(1); ; v++ {
		name, ok := controlv1.RunNodeState_name[v]
		if !ok {
			return parts
		}
		key := enumName(name, "RUN_NODE_STATE_")
		if n := r.GetCounts()[key]; n > 0 {
			parts = append(parts, format(key, n))
		}
	}
}

// countsLine is a run's node counts: "3 node(s): 1 failed, 2 not_started".
func countsLine(r *controlv1.Run) string {
	parts := nodeCounts(r, func(state string, n int32) string { return fmt.Sprintf("%d %s", n, state) })
	if len(parts) == 0 {
		return fmt.Sprintf("%d node(s)", r.GetTotal())
	}
	return fmt.Sprintf("%d node(s): %s", r.GetTotal(), strings.Join(parts, ", "))
}

// printRunSummary prints each node's result, the counts and the run's
// outcome on stderr.
func (a *app) printRunSummary(run *controlv1.Run, nodes []*controlv1.RunNode) {
	sorted := append([]*controlv1.RunNode(nil), nodes...)
	sort.SliceStable(sorted, func(i, j int) bool { return sorted[i].GetNodeId() < sorted[j].GetNodeId() })
	_, _ = fmt.Fprintln(a.stderr)
	t := newTable(a.stderr, "NODE", "RESULT", "COMMAND")
	for _, n := range sorted {
		t.row(n.GetNodeId(), describeRunNode(n), n.GetCommandId())
	}
	_ = t.flush()
	_, _ = fmt.Fprintln(a.stderr, countsLine(run))
	outcome := fmt.Sprintf("run %s %s", run.GetId(), runState(run.GetState()))
	if run.GetReason() != "" {
		outcome += ": " + oneLine(run.GetReason())
	}
	_, _ = fmt.Fprintln(a.stderr, outcome)
}

// errorLine is err on one line, as the summary shows it.
func errorLine(err error) string {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Code().String() + ": " + oneLine(ce.Message())
	}
	return oneLine(err.Error())
}

// outputSink receives each node's output.
type outputSink interface {
	write(node string, stream nodev1.OutputStream, data []byte)
	// done flushes what is left of a node's output.
	done(node string)
}

// prefixSink writes each node's output line by line, prefixed by "NODE: "
// (stdout to out, stderr to errOut); with prefix false it passes bytes
// through as they come.
type prefixSink struct {
	mu          sync.Mutex
	out, errOut io.Writer
	prefix      bool
	partial     map[string]*bytes.Buffer // node/stream -> an unfinished line
}

func newPrefixSink(out, errOut io.Writer, prefix bool) *prefixSink {
	return &prefixSink{out: out, errOut: errOut, prefix: prefix, partial: map[string]*bytes.Buffer{}}
}

func (p *prefixSink) target(st nodev1.OutputStream) io.Writer {
	if st == nodev1.OutputStream_OUTPUT_STREAM_STDERR {
		return p.errOut
	}
	return p.out
}

func (p *prefixSink) write(node string, st nodev1.OutputStream, data []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	w := p.target(st)
	if !p.prefix {
		_, _ = w.Write(data)
		return
	}
	key := node + "\x00" + st.String()
	buf := p.partial[key]
	if buf == nil {
		buf = &bytes.Buffer{}
		p.partial[key] = buf
	}
	buf.Write(data)
	for {
		line, err := buf.ReadBytes('\n')
		if err != nil { // no newline: keep the rest for later
			rest := append([]byte(nil), line...)
			buf.Reset()
			buf.Write(rest)
			return
		}
		_, _ = fmt.Fprintf(w, "%s: %s", node, line)
	}
}

func (p *prefixSink) done(node string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, st := range []nodev1.OutputStream{nodev1.OutputStream_OUTPUT_STREAM_STDOUT, nodev1.OutputStream_OUTPUT_STREAM_STDERR} {
		key := node + "\x00" + st.String()
		if buf := p.partial[key]; buf != nil && buf.Len() > 0 {
			_, _ = fmt.Fprintf(p.target(st), "%s: %s\n", node, buf.String())
			buf.Reset()
		}
	}
}

// execPayload is the protobuf JSON of an exec of argv, compacted:
// protojson's spacing is deliberately unstable, and a payload should be
// the same bytes for the same command (what a run shows, what an
// idempotency key compares).
func execPayload(argv []string) ([]byte, error) {
	raw, err := protojson.Marshal(&nodev1.ExecPayload{Argv: argv})
	if err != nil {
		return nil, fmt.Errorf("encode the exec payload: %w", err)
	}
	var out bytes.Buffer
	if err := json.Compact(&out, raw); err != nil {
		return nil, fmt.Errorf("encode the exec payload: %w", err)
	}
	return out.Bytes(), nil
}
