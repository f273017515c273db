package cli

import (
	"fmt"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/durationpb"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
)

func parseRunState(s string) (controlv1.RunState, error) {
	if s == "" {
		return 0, nil
	}
	up := strings.ToUpper(s)
	if v, ok := controlv1.RunState_value["RUN_STATE_"+strings.TrimPrefix(up, "RUN_STATE_")]; ok && v != 0 {
		return controlv1.RunState(v), nil
	}
	return 0, usagef("--state: unknown run state %q (want running, succeeded, failed or cancelled)", s)
}

func (a *app) runsCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "runs",
		Short: "List, inspect, wait for and cancel runs (leasehold run creates them)",
	}
	cmd.AddCommand(a.runsLsCommand(), a.runsGetCommand(), a.runsCancelCommand(), a.runsWaitCommand())
	return cmd
}

// runTarget is a run's target as one line: the named nodes, the selector
// and the pool.
func runTarget(t *controlv1.RunTarget) string {
	var parts []string
	if ids := t.GetNodeIds(); len(ids) > 0 {
		parts = append(parts, strings.Join(ids, ","))
	}
	if t.GetSelector() != "" {
		parts = append(parts, "-l "+t.GetSelector())
	}
	if t.GetPoolId() != "" {
		parts = append(parts, "pool "+t.GetPoolId())
	}
	return strings.Join(parts, " ")
}

// runCounts is a run's node counts as state=n.
func runCounts(r *controlv1.Run) string {
	return strings.Join(nodeCounts(r, func(state string, n int32) string { return fmt.Sprintf("%s=%d", state, n) }), ",")
}

func (a *app) runsLsCommand() *cobra.Command {
	var state string
	var limit int
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List runs, newest first",
		Args:    exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			st, err := parseRunState(state)
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
			all := &controlv1.ListRunsResponse{}
			req := &controlv1.ListRunsRequest{State: st}
			for len(all.Runs) < limit {
				req.PageSize = int32(min(limit-len(all.Runs), 1000))
				res, err := s.client.ListRuns(cmd.Context(), connect.NewRequest(req))
				if err != nil {
					return s.explain(err)
				}
				all.Runs = append(all.Runs, res.Msg.GetRuns()...)
				if req.PageToken = res.Msg.GetNextPageToken(); req.PageToken == "" {
					break
				}
			}
			if len(all.Runs) > limit {
				all.Runs = all.Runs[:limit]
			}
			if structured(a.output) {
				return printMessage(a.stdout, a.output, all)
			}
			wide := a.output == formatWide
			h := []string{"RUN", "STATE", "NODES", "COUNTS", "AGE"}
			if wide {
				h = append(h, "TARGET", "IN FLIGHT", "MAX FAILURES", "CREATED", "FINISHED", "REASON")
			}
			t := newTable(a.stdout, h...)
			now := time.Now()
			for _, r := range all.GetRuns() {
				row := []string{r.GetId(), runState(r.GetState()), fmt.Sprint(r.GetTotal()), runCounts(r), age(now, r.GetCreatedAt())}
				if wide {
					row = append(row, runTarget(r.GetTarget()), fmt.Sprint(r.GetMaxInFlight()), fmt.Sprint(r.GetMaxFailures()),
						timestamp(r.GetCreatedAt()), timestamp(r.GetFinishedAt()), oneLine(r.GetReason()))
				}
				t.row(row...)
			}
			return t.flush()
		},
	}
	f := cmd.Flags()
	f.StringVar(&state, "state", "", "only runs in this state: running, succeeded, failed or cancelled")
	f.IntVar(&limit, "limit", 50, "how many runs at most")
	return cmd
}

func (a *app) runsGetCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "get RUN",
		Short: "Show one run and its nodes",
		Args:  exactArgs(1, "RUN"),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := a.dial()
			if err != nil {
				return err
			}
			res, err := s.client.GetRun(cmd.Context(), connect.NewRequest(&controlv1.GetRunRequest{RunId: args[0]}))
			if err != nil {
				return s.explain(err)
			}
			if structured(a.output) {
				return printMessage(a.stdout, a.output, res.Msg)
			}
			r := res.Msg.GetRun()
			t := newTable(a.stdout)
			t.row("Run:", r.GetId())
			t.row("Target:", runTarget(r.GetTarget()))
			t.row("Kind:", r.GetKind())
			if r.GetKind() == "exec" {
				t.row("Payload:", string(r.GetPayload()))
			}
			t.row("State:", runState(r.GetState()))
			t.row("Reason:", oneLine(r.GetReason()))
			t.row("Nodes:", countsLine(r))
			t.row("Max in flight:", fmt.Sprint(r.GetMaxInFlight()))
			t.row("Max failures:", fmt.Sprint(r.GetMaxFailures()))
			t.row("Command timeout:", durationString(r.GetCommandTimeout()))
			t.row("Pause:", durationString(r.GetBatchPause()))
			t.row("Created:", timestamp(r.GetCreatedAt()))
			t.row("Finished:", timestamp(r.GetFinishedAt()))
			if err := t.flush(); err != nil {
				return err
			}
			_, _ = fmt.Fprintln(a.stdout)
			wide := a.output == formatWide
			h := []string{"NODE", "STATE", "EXIT CODE", "ERROR", "COMMAND"}
			if wide {
				h = append(h, "STARTED", "FINISHED")
			}
			nt := newTable(a.stdout, h...)
			for _, n := range res.Msg.GetNodes() {
				exit := ""
				if n.GetState() == controlv1.RunNodeState_RUN_NODE_STATE_SUCCEEDED || n.GetState() == controlv1.RunNodeState_RUN_NODE_STATE_FAILED {
					exit = fmt.Sprint(n.GetExitCode())
				}
				row := []string{n.GetNodeId(), runNodeState(n.GetState()), exit, oneLine(n.GetError()), n.GetCommandId()}
				if wide {
					row = append(row, timestamp(n.GetStartedAt()), timestamp(n.GetFinishedAt()))
				}
				nt.row(row...)
			}
			return nt.flush()
		},
	}
}

func (a *app) runsCancelCommand() *cobra.Command {
	var reason string
	cmd := &cobra.Command{
		Use:   "cancel RUN",
		Short: "Cancel a run: start no more nodes, cancel the running ones' commands (an ended run is left as it is)",
		Args:  exactArgs(1, "RUN"),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := a.dial()
			if err != nil {
				return err
			}
			res, err := s.client.CancelRun(cmd.Context(), connect.NewRequest(&controlv1.CancelRunRequest{RunId: args[0], Reason: reason}))
			if err != nil {
				return s.explain(err)
			}
			if structured(a.output) {
				return printMessage(a.stdout, a.output, res.Msg)
			}
			_, err = fmt.Fprintf(a.stdout, "run %s: %s\n", args[0], runState(res.Msg.GetRun().GetState()))
			return err
		},
	}
	cmd.Flags().StringVar(&reason, "reason", "cancelled from the CLI", "why, for the run and the audit trail")
	return cmd
}

func (a *app) runsWaitCommand() *cobra.Command {
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "wait RUN",
		Short: "Wait until a run has ended (exit 0 when it succeeded, 1 otherwise)",
		Args:  exactArgs(1, "RUN"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if timeout < 0 {
				return usagef("--timeout must not be negative")
			}
			s, err := a.dial()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			var deadline time.Time
			if timeout > 0 {
				deadline = time.Now().Add(timeout)
			}
			var run *controlv1.Run
			for {
				wait := 30 * time.Second
				if !deadline.IsZero() {
					wait = min(wait, time.Until(deadline))
				}
				res, err := s.client.WaitRun(ctx, connect.NewRequest(&controlv1.WaitRunRequest{RunId: args[0], Timeout: durationpb.New(max(wait, 0))}))
				if err != nil {
					if ctx.Err() != nil {
						return interrupted
					}
					return s.explain(err)
				}
				run = res.Msg.GetRun()
				if terminalRun(run.GetState()) || (!deadline.IsZero() && !time.Now().Before(deadline)) {
					break
				}
			}
			if structured(a.output) {
				if err := printMessage(a.stdout, a.output, run); err != nil {
					return err
				}
			} else {
				line := fmt.Sprintf("run %s: %s (%s)", run.GetId(), runState(run.GetState()), countsLine(run))
				if run.GetReason() != "" {
					line += ": " + oneLine(run.GetReason())
				}
				_, _ = fmt.Fprintln(a.stdout, line)
			}
			switch {
			case run.GetState() == controlv1.RunState_RUN_STATE_SUCCEEDED:
				return nil
			case !terminalRun(run.GetState()):
				return &exitError{code: exitFailed, msg: fmt.Sprintf("run %s has not ended within %s", run.GetId(), timeout)}
			}
			return &exitError{code: exitFailed}
		},
	}
	cmd.Flags().DurationVar(&timeout, "timeout", 0, "give up after this long (exit 1); 0: wait as long as it takes")
	return cmd
}
