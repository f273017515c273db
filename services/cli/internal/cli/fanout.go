package cli

// The client-side fan-out of `leasehold run`: everything about creating the
// commands, bounding how many run at once, following their output and
// cancelling them lives in this file, so a server-side run API can replace
// it without touching the command's flags or its printing.

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/durationpb"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// fanOutSpec is one run across nodes.
type fanOutSpec struct {
	nodes       []string
	argv        []string
	timeout     time.Duration // 0: the api's default
	maxInFlight int
}

// nodeOutcome is how the run went on one node.
type nodeOutcome struct {
	node      string
	commandID string
	state     controlv1.CommandState
	exitCode  int32
	// err is why the command could not be created or followed, or the
	// node's error for it.
	err string
}

func (o nodeOutcome) succeeded() bool {
	return o.err == "" && o.state == controlv1.CommandState_COMMAND_STATE_SUCCEEDED
}

// window calls fn(i) for i in [0, n) with at most limit calls running at
// once: when one returns, the next starts (a sliding window, not batches).
// Once ctx is done no new call starts. It returns when every started call
// has returned.
func window(ctx context.Context, n, limit int, fn func(i int)) {
	if limit < 1 {
		limit = 1
	}
	slots := make(chan struct{}, limit)
	var wg sync.WaitGroup
	for i := range n {
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
		wg.Go(func() {
			defer func() { <-slots }()
			fn(i)
		})
	}
	wg.Wait()
}

// outputSink receives each node's output.
type outputSink interface {
	write(node string, stream nodev1.OutputStream, data []byte)
	// done flushes what is left of a node's output.
	done(node string)
}

// fanOut creates an exec command per node, at most spec.maxInFlight at
// once, streams each one's output to sink until it ends, and returns the
// outcome per node (in spec.nodes' order). When ctx is cancelled (Ctrl-C)
// it starts no new command, cancels (CancelCommand) every command it
// created that had not finished, and reports cancelled = true.
func (s *session) fanOut(ctx context.Context, spec fanOutSpec, sink outputSink) (outcomes []nodeOutcome, cancelled int, err error) {
	payload, err := protojson.Marshal(&nodev1.ExecPayload{Argv: spec.argv})
	if err != nil {
		return nil, 0, fmt.Errorf("encode the exec payload: %w", err)
	}
	var runID [8]byte
	_, _ = rand.Read(runID[:])
	outcomes = make([]nodeOutcome, len(spec.nodes))
	var mu sync.Mutex
	created := map[string]bool{}      // command id -> finished
	unanswered := map[string]string{} // node -> idempotency key of a create with no answer
	window(ctx, len(spec.nodes), spec.maxInFlight, func(i int) {
		node := spec.nodes[i]
		o := nodeOutcome{node: node}
		defer func() { outcomes[i] = o }()
		req := &controlv1.CreateCommandRequest{NodeId: node, Kind: "exec", Payload: payload,
			// One key per run and node: a retried create returns the same command.
			IdempotencyKey: "leasehold-run-" + hex.EncodeToString(runID[:]) + "-" + node}
		if spec.timeout > 0 {
			req.Expiry = &controlv1.CreateCommandRequest_Timeout{Timeout: durationpb.New(spec.timeout)}
		}
		var res *connect.Response[controlv1.CreateCommandResponse]
		var err error
		for attempt := 0; ; attempt++ {
			res, err = s.client.CreateCommand(ctx, connect.NewRequest(req))
			if err == nil || connect.CodeOf(err) != connect.CodeUnavailable || attempt == 2 || ctx.Err() != nil {
				break
			}
			time.Sleep(time.Duration(attempt+1) * 300 * time.Millisecond) // back-off of a retried create
		}
		if err != nil {
			if ctx.Err() != nil {
				// Interrupted mid-create: it may have been created.
				mu.Lock()
				unanswered[node] = req.GetIdempotencyKey()
				mu.Unlock()
			}
			o.err = errorLine(s.explain(err))
			return
		}
		o.commandID = res.Msg.GetCommand().GetId()
		mu.Lock()
		created[o.commandID] = false
		mu.Unlock()
		_, truncated, err := s.streamOutput(ctx, o.commandID, 0, -1, func(st nodev1.OutputStream, b []byte) { sink.write(node, st, b) })
		sink.done(node)
		if err != nil {
			o.err = errorLine(err)
			return
		}
		if truncated {
			sink.write(node, nodev1.OutputStream_OUTPUT_STREAM_STDERR, []byte("(output truncated at the gateway's cap)\n"))
			sink.done(node)
		}
		// The stream ended: the command is terminal. WaitCommand returns
		// at once then, with the result.
		w, err := s.client.WaitCommand(ctx, connect.NewRequest(&controlv1.WaitCommandRequest{CommandId: o.commandID, Timeout: durationpb.New(30 * time.Second)}))
		if err != nil {
			o.err = errorLine(s.explain(err))
			return
		}
		o.state = w.Msg.GetCommand().GetState()
		o.exitCode = w.Msg.GetResult().GetExitCode()
		if e := w.Msg.GetResult().GetError(); e != "" && !o.succeeded() {
			o.err = oneLine(e)
		}
		if terminal(o.state) {
			mu.Lock()
			created[o.commandID] = true
			mu.Unlock()
		}
	})
	if ctx.Err() == nil {
		return outcomes, 0, nil
	}
	// Interrupted: cancel what this run started and has not finished.
	cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// A create interrupted before its answer: find it by its idempotency
	// key among the node's newest commands.
	for node, key := range unanswered {
		res, err := s.client.ListCommands(cctx, connect.NewRequest(&controlv1.ListCommandsRequest{NodeId: node, PageSize: 20}))
		if err != nil {
			continue
		}
		for _, c := range res.Msg.GetCommands() {
			if c.GetIdempotencyKey() == key {
				created[c.GetId()] = terminal(c.GetState())
			}
		}
	}
	for id, finished := range created {
		if finished {
			continue
		}
		if _, err := s.client.CancelCommand(cctx, connect.NewRequest(&controlv1.CancelCommandRequest{CommandId: id})); err == nil {
			cancelled++
		}
	}
	return outcomes, cancelled, ctx.Err()
}

// errorLine is err on one line, as the summary shows it.
func errorLine(err error) string {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Code().String() + ": " + oneLine(ce.Message())
	}
	return oneLine(err.Error())
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
