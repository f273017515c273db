package cli

import (
	"context"
	"fmt"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

func commandState(s controlv1.CommandState) string { return enumName(s.String(), "COMMAND_STATE_") }

func terminal(s controlv1.CommandState) bool {
	switch s {
	case controlv1.CommandState_COMMAND_STATE_SUCCEEDED, controlv1.CommandState_COMMAND_STATE_FAILED,
		controlv1.CommandState_COMMAND_STATE_CANCELLED, controlv1.CommandState_COMMAND_STATE_EXPIRED:
		return true
	}
	return false
}

func parseCommandState(s string) (controlv1.CommandState, error) {
	if s == "" {
		return 0, nil
	}
	up := strings.ToUpper(s)
	if v, ok := controlv1.CommandState_value["COMMAND_STATE_"+strings.TrimPrefix(up, "COMMAND_STATE_")]; ok && v != 0 {
		return controlv1.CommandState(v), nil
	}
	return 0, usagef("--state: unknown command state %q (want pending, dispatched, running, succeeded, failed, cancelled or expired)", s)
}

func (a *app) commandsCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:     "commands",
		Aliases: []string{"command", "cmd"},
		Short:   "List and inspect commands",
	}
	cmd.AddCommand(a.commandsLsCommand(), a.commandsGetCommand())
	return cmd
}

func (a *app) commandsLsCommand() *cobra.Command {
	var node, state string
	var limit int
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List commands, newest first",
		Args:    exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			st, err := parseCommandState(state)
			if err != nil {
				return err
			}
			if limit < 1 {
				return usagef("--limit must be at least 1")
			}
			s, err := a.dial()
			if err != nil {
				return err
			}
			all := &controlv1.ListCommandsResponse{}
			req := &controlv1.ListCommandsRequest{NodeId: node, State: st}
			for len(all.Commands) < limit {
				req.PageSize = int32(min(limit-len(all.Commands), 1000))
				res, err := s.client.ListCommands(cmd.Context(), connect.NewRequest(req))
				if err != nil {
					return s.explain(err)
				}
				all.Commands = append(all.Commands, res.Msg.GetCommands()...)
				if req.PageToken = res.Msg.GetNextPageToken(); req.PageToken == "" {
					break
				}
			}
			if len(all.Commands) > limit {
				all.Commands = all.Commands[:limit]
			}
			if structured(a.output) {
				return printMessage(a.stdout, a.output, all)
			}
			wide := a.output == formatWide
			h := []string{"COMMAND", "NODE", "KIND", "STATE", "AGE"}
			if wide {
				h = append(h, "DISPATCHES", "OUTPUT BYTES", "DEADLINE", "CREATED")
			}
			t := newTable(a.stdout, h...)
			now := time.Now()
			for _, c := range all.GetCommands() {
				r := []string{c.GetId(), c.GetNodeId(), c.GetKind(), commandState(c.GetState()), age(now, c.GetCreatedAt())}
				if wide {
					r = append(r, fmt.Sprint(c.GetDispatchCount()), fmt.Sprint(c.GetOutputBytes()), timestamp(c.GetDeadline()), timestamp(c.GetCreatedAt()))
				}
				t.row(r...)
			}
			return t.flush()
		},
	}
	f := cmd.Flags()
	f.StringVar(&node, "node", "", "only commands for this node")
	f.StringVar(&state, "state", "", "only commands in this state")
	f.IntVar(&limit, "limit", 50, "how many commands at most")
	_ = cmd.RegisterFlagCompletionFunc("node", a.completeNodes)
	return cmd
}

func (a *app) commandsGetCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "get COMMAND",
		Short: "Show one command and its result",
		Args:  exactArgs(1, "COMMAND"),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := a.dial()
			if err != nil {
				return err
			}
			res, err := s.client.GetCommand(cmd.Context(), connect.NewRequest(&controlv1.GetCommandRequest{CommandId: args[0]}))
			if err != nil {
				return s.explain(err)
			}
			if structured(a.output) {
				return printMessage(a.stdout, a.output, res.Msg)
			}
			c, r := res.Msg.GetCommand(), res.Msg.GetResult()
			t := newTable(a.stdout)
			t.row("Command:", c.GetId())
			t.row("Node:", c.GetNodeId())
			t.row("Kind:", c.GetKind())
			if c.GetKind() == "exec" {
				t.row("Payload:", string(c.GetPayload()))
			}
			t.row("State:", commandState(c.GetState()))
			t.row("Created:", timestamp(c.GetCreatedAt()))
			t.row("Deadline:", timestamp(c.GetDeadline()))
			t.row("Dispatches:", fmt.Sprint(c.GetDispatchCount()))
			t.row("Output bytes:", fmt.Sprintf("%d%s", c.GetOutputBytes(), map[bool]string{true: " (truncated)"}[c.GetOutputTruncated()]))
			if c.GetCancelRequestedAt() != nil {
				t.row("Cancel requested:", timestamp(c.GetCancelRequestedAt()))
				t.row("Cancel outcome:", c.GetCancelOutcome())
			}
			if r != nil {
				t.row("Exit code:", fmt.Sprint(r.GetExitCode()))
				t.row("Error:", r.GetError())
				t.row("Started:", timestamp(r.GetStartedAt()))
				t.row("Finished:", timestamp(r.GetFinishedAt()))
			}
			return t.flush()
		},
	}
}

func (a *app) cancelCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "cancel COMMAND",
		Short: "Cancel a command that has not finished (a finished one is left as it is)",
		Args:  exactArgs(1, "COMMAND"),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := a.dial()
			if err != nil {
				return err
			}
			res, err := s.client.CancelCommand(cmd.Context(), connect.NewRequest(&controlv1.CancelCommandRequest{CommandId: args[0]}))
			if err != nil {
				return s.explain(err)
			}
			if structured(a.output) {
				return printMessage(a.stdout, a.output, res.Msg)
			}
			_, err = fmt.Fprintf(a.stdout, "command %s: %s\n", args[0], commandState(res.Msg.GetCommand().GetState()))
			return err
		},
	}
}

func (a *app) logsCommand() *cobra.Command {
	var follow bool
	cmd := &cobra.Command{
		Use:   "logs COMMAND|RUN",
		Short: "Print a command's output, or every node's output of a run (stdout to stdout, stderr to stderr)",
		Long: `Print a command's output (StreamCommandOutput from offset 0): what is stored
now, or with -f everything until the command has ended, including what the
node's gateway relays live past the stored part.
Given a run, print the output of each of its nodes' commands, each line
prefixed by its node, node after node; with -f follow the run as
leasehold run does, until the run has ended and every output is read.`,
		Args: exactArgs(1, "COMMAND or RUN"),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := a.dial()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			run, err := s.client.GetRun(ctx, connect.NewRequest(&controlv1.GetRunRequest{RunId: args[0]}))
			switch {
			case err == nil:
				return a.runLogs(ctx, s, run.Msg, follow)
			case connect.CodeOf(err) != connect.CodeNotFound:
				return s.explain(err)
			}
			stop := int64(-1)
			if !follow {
				res, err := s.client.GetCommand(ctx, connect.NewRequest(&controlv1.GetCommandRequest{CommandId: args[0]}))
				if err != nil {
					return s.explain(err) // NOT_FOUND: no such run either
				}
				if !terminal(res.Msg.GetCommand().GetState()) {
					stop = res.Msg.GetCommand().GetOutputBytes()
				}
			}
			end, truncated, err := s.streamOutput(ctx, args[0], 0, stop, func(st nodev1.OutputStream, b []byte) {
				if st == nodev1.OutputStream_OUTPUT_STREAM_STDERR {
					_, _ = a.stderr.Write(b)
				} else {
					_, _ = a.stdout.Write(b)
				}
			})
			if err != nil {
				if ctx.Err() != nil {
					return interrupted
				}
				return err
			}
			if truncated {
				_, _ = fmt.Fprintln(a.stderr, "leasehold: "+notKept(end))
			}
			return nil
		},
	}
	cmd.Flags().BoolVarP(&follow, "follow", "f", false, "follow the output until the command (or the run) ends")
	return cmd
}

// runLogs prints the output of a run's nodes, prefixed by node: what is
// stored now, node after node in node order, or with follow everything
// until the run has ended (followRun).
func (a *app) runLogs(ctx context.Context, s *session, run *controlv1.GetRunResponse, follow bool) error {
	sink := newPrefixSink(a.stdout, a.stderr, true)
	if follow {
		if err := s.followRun(ctx, run.GetRun().GetId(), sink); err != nil {
			if ctx.Err() != nil {
				return interrupted
			}
			return err
		}
		return nil
	}
	for _, n := range run.GetNodes() {
		id, node := n.GetCommandId(), n.GetNodeId()
		if id == "" {
			continue // not started (yet, or skipped): no output
		}
		res, err := s.client.GetCommand(ctx, connect.NewRequest(&controlv1.GetCommandRequest{CommandId: id}))
		if err != nil {
			return s.explain(err)
		}
		stop := int64(-1)
		if !terminal(res.Msg.GetCommand().GetState()) {
			stop = res.Msg.GetCommand().GetOutputBytes()
		}
		end, truncated, err := s.streamOutput(ctx, id, 0, stop, func(st nodev1.OutputStream, b []byte) { sink.write(node, st, b) })
		sink.done(node)
		if err != nil {
			if ctx.Err() != nil {
				return interrupted
			}
			return err
		}
		if truncated {
			sink.write(node, nodev1.OutputStream_OUTPUT_STREAM_STDERR, []byte("("+notKept(end)+")\n"))
			sink.done(node)
		}
	}
	return nil
}

// notKept says that a command's output from byte end on was not kept: past
// what the database stores and the gateway kept, and not followed live.
func notKept(end int64) string {
	return fmt.Sprintf("output from byte %d on was not kept (the database keeps the first --gateway.output-cap bytes; the node's gateway relays the rest to readers that follow the command, and keeps 8 MiB more for 30 s after it ends)", end)
}

// streamOutput reads a command's output from offset and hands each piece
// to emit, until the stream ends (the command finished and everything was
// sent), or, when stop >= 0, once stop bytes were read. A stream the api
// ends with DEADLINE_EXCEEDED (its 60 s bound on one call) is resumed from
// the next offset at once, however often; one that ends UNAVAILABLE (a
// replica stopping) is resumed after a back-off, up to 5 times in a row
// without data. It returns the offset reached and whether the output was
// truncated.
func (s *session) streamOutput(ctx context.Context, id string, offset, stop int64, emit func(nodev1.OutputStream, []byte)) (int64, bool, error) {
	retries := 0
	for {
		if stop >= 0 && offset >= stop {
			return offset, false, nil
		}
		opened := time.Now()
		st, err := s.client.StreamCommandOutput(ctx, connect.NewRequest(&controlv1.StreamCommandOutputRequest{CommandId: id, Offset: offset}))
		if err != nil {
			return offset, false, s.explain(err)
		}
		truncated := false
		for st.Receive() {
			m := st.Msg()
			if m.GetTruncated() {
				truncated = true
				continue
			}
			data := m.GetData()
			if m.GetOffset() < offset { // already seen
				skip := offset - m.GetOffset()
				if skip >= int64(len(data)) {
					continue
				}
				data = data[skip:]
			}
			if stop >= 0 && offset+int64(len(data)) > stop {
				data = data[:stop-offset]
			}
			emit(m.GetStream(), data)
			offset += int64(len(data))
			retries = 0
			if stop >= 0 && offset >= stop {
				_ = st.Close()
				return offset, false, nil
			}
		}
		err = st.Err()
		_ = st.Close()
		if err == nil {
			return offset, truncated, nil
		}
		code := connect.CodeOf(err)
		if ctx.Err() != nil {
			return offset, truncated, ctx.Err()
		}
		if code == connect.CodeDeadlineExceeded {
			if time.Since(opened) < time.Second { // not the 60 s bound: do not spin
				time.Sleep(500 * time.Millisecond)
			}
			continue
		}
		if code != connect.CodeUnavailable || retries >= 5 {
			return offset, truncated, s.explain(err)
		}
		retries++
		select {
		case <-ctx.Done():
			return offset, truncated, ctx.Err()
		case <-time.After(time.Duration(retries) * 200 * time.Millisecond): // back-off before resuming
		}
	}
}
