package cli

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/spf13/cobra"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/selector"
)

func (a *app) runCommand() *cobra.Command {
	var selectorFlag string
	var timeout time.Duration
	var maxInFlight int
	cmd := &cobra.Command{
		Use:   "run NODE... [-l SELECTOR] [--timeout D] [--max-in-flight N] -- ARGV...",
		Short: "Run a program on nodes (an exec command each) and stream its output",
		Long: `Run ARGV (no shell: wrap it in sh -c '...' for one) as an exec command on each
NODE, and on each connected node that matches -l. At most --max-in-flight
commands run at once: as one node finishes, the next starts. Output streams
live as the nodes write it, each line prefixed by "NODE: " when there are
several nodes (stdout to stdout, stderr to stderr); a summary follows on
stderr.

Exit status: 0 when the command succeeded on every node, 1 otherwise, 130
on Ctrl-C, which cancels (CancelCommand) the commands already started.

The fan-out is done by this client: if it dies, the commands it created run
on; leasehold commands ls shows them.`,
		Example: `  leasehold run node-1 -- uname -a
  leasehold run -l 'rack in (r1,r2),!canary' --max-in-flight 10 -- systemctl restart app`,
		ValidArgsFunction: a.completeNodes,
		RunE: func(cmd *cobra.Command, args []string) error {
			dash := cmd.ArgsLenAtDash()
			if dash < 0 || dash == len(args) {
				return usagef("no program: put it after --, e.g. leasehold run node-1 -- uname -a")
			}
			nodes, argv := append([]string(nil), args[:dash]...), args[dash:]
			sel, err := selector.Parse(selectorFlag)
			if err != nil {
				return usagef("-l: selector %q: %v", selectorFlag, err)
			}
			if len(nodes) == 0 && selectorFlag == "" {
				return usagef("no node: name nodes or select them with -l")
			}
			if maxInFlight < 1 {
				return usagef("--max-in-flight must be at least 1")
			}
			if timeout != 0 && (timeout < time.Second || timeout > 7*24*time.Hour) {
				return usagef("--timeout %s: must be between 1s and 168h (or 0 for the api's default)", timeout)
			}
			for _, arg := range argv {
				if strings.ContainsRune(arg, 0) {
					return usagef("the program's arguments must not contain NUL")
				}
			}
			s, err := a.dial()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			if selectorFlag != "" {
				matched, err := s.listNodes(ctx, &controlv1.ListNodesRequest{State: controlv1.NodeState_NODE_STATE_CONNECTED}, sel)
				if err != nil {
					return err
				}
				if len(matched) == 0 && len(nodes) == 0 {
					return &exitError{code: exitFailed, msg: fmt.Sprintf("no connected node matches -l %q", sel.String())}
				}
				for _, n := range matched {
					nodes = append(nodes, n.GetId())
				}
			}
			nodes = dedupe(nodes)
			if dash > 0 {
				a.warnNotConnected(ctx, s, dedupe(args[:dash]), timeout)
			}
			several := len(nodes) > 1
			sink := newPrefixSink(a.stdout, a.stderr, several)
			outcomes, cancelled, err := s.fanOut(ctx, fanOutSpec{nodes: nodes, argv: argv, timeout: timeout, maxInFlight: maxInFlight}, sink)
			if err != nil && ctx.Err() == nil {
				return err
			}
			if ctx.Err() != nil {
				return &exitError{code: exitInterrupted, msg: fmt.Sprintf("interrupted: cancelled %d command(s)", cancelled)}
			}
			failed := 0
			for _, o := range outcomes {
				if !o.succeeded() {
					failed++
				}
			}
			if several {
				a.printRunSummary(outcomes, failed)
			} else if failed > 0 {
				o := outcomes[0]
				return &exitError{code: exitFailed, msg: fmt.Sprintf("%s: %s", o.node, describeOutcome(o))}
			}
			if failed > 0 {
				return &exitError{code: exitFailed}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVarP(&selectorFlag, "selector", "l", "", "also run on the connected nodes matching this label selector (k=v, k!=v, 'k in (a,b)', 'k notin (a,b)', k, !k; applied by the client)")
	f.DurationVar(&timeout, "timeout", 0, "the commands' timeout, 1s..168h (0: the api's default, 1h)")
	f.IntVar(&maxInFlight, "max-in-flight", 50, "how many nodes run the command at once")
	return cmd
}

// warnNotConnected says which named nodes are not connected: their
// commands wait, pending, until the node connects or the timeout passes.
func (a *app) warnNotConnected(ctx context.Context, s *session, named []string, timeout time.Duration) {
	all, err := s.listNodes(ctx, &controlv1.ListNodesRequest{}, selector.Selector{})
	if err != nil {
		return // the creates will say what is wrong
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
		if st, ok := state[id]; ok && st != controlv1.NodeState_NODE_STATE_CONNECTED {
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

// describeOutcome is one node's result as the summary shows it.
func describeOutcome(o nodeOutcome) string {
	switch {
	case o.succeeded():
		return "succeeded"
	case o.commandID == "":
		return "not started: " + o.err
	case o.state == controlv1.CommandState_COMMAND_STATE_FAILED && o.err == "":
		return fmt.Sprintf("failed: exit code %d", o.exitCode)
	case o.err != "":
		return commandState(o.state) + ": " + o.err
	}
	return commandState(o.state)
}

func (a *app) printRunSummary(outcomes []nodeOutcome, failed int) {
	sorted := append([]nodeOutcome(nil), outcomes...)
	sort.SliceStable(sorted, func(i, j int) bool { return sorted[i].node < sorted[j].node })
	_, _ = fmt.Fprintln(a.stderr)
	t := newTable(a.stderr, "NODE", "RESULT", "COMMAND")
	for _, o := range sorted {
		t.row(o.node, describeOutcome(o), o.commandID)
	}
	_ = t.flush()
	_, _ = fmt.Fprintf(a.stderr, "%d node(s): %d succeeded, %d failed\n", len(outcomes), len(outcomes)-failed, failed)
}
