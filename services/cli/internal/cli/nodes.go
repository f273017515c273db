package cli

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/selector"
)

// parseNodeState accepts connected, NODE_STATE_CONNECTED, CONNECTED.
func parseNodeState(s string) (controlv1.NodeState, error) {
	if s == "" {
		return controlv1.NodeState_NODE_STATE_UNSPECIFIED, nil
	}
	up := strings.ToUpper(s)
	if v, ok := controlv1.NodeState_value["NODE_STATE_"+strings.TrimPrefix(up, "NODE_STATE_")]; ok && v != 0 {
		return controlv1.NodeState(v), nil
	}
	return 0, usagef("--state: unknown node state %q (want registered, connected, disconnected, unreachable or revoked)", s)
}

func nodeState(s controlv1.NodeState) string { return enumName(s.String(), "NODE_STATE_") }

// listNodes pages through ListNodes with the server-side filters and applies
// the selector on the client.
func (s *session) listNodes(ctx context.Context, req *controlv1.ListNodesRequest, sel selector.Selector) ([]*controlv1.Node, error) {
	var out []*controlv1.Node
	req = proto.CloneOf(req)
	req.PageSize = 1000
	for {
		res, err := s.client.ListNodes(ctx, connect.NewRequest(req))
		if err != nil {
			return nil, s.explain(err)
		}
		for _, n := range res.Msg.GetNodes() {
			if sel.Matches(n.GetLabels()) {
				out = append(out, n)
			}
		}
		if res.Msg.GetNextPageToken() == "" {
			return out, nil
		}
		req.PageToken = res.Msg.GetNextPageToken()
	}
}

func (a *app) nodesCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:     "nodes",
		Aliases: []string{"node"},
		Short:   "List and inspect nodes",
	}
	cmd.AddCommand(a.nodesLsCommand(), a.nodesGetCommand(), a.nodesDescribeCommand())
	return cmd
}

const selectorHelp = `label selector, kubectl-style: k=v, k!=v, 'k in (a,b)', 'k notin (a,b)', k, !k, comma-separated (applied by the client: ListNodes does not filter by label)`

func (a *app) nodesLsCommand() *cobra.Command {
	var selectorFlag, state, pool string
	var cordoned, watch bool
	var interval time.Duration
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List nodes",
		Long: `List nodes, ordered by id.

--state, --pool and --cordoned are filtered by the server (ListNodes);
-l (labels) is applied by the client to every page.

--watch prints the list, then a line for each node that appears or changes,
polling every --watch-interval, until Ctrl-C.`,
		Args: exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			sel, err := selector.Parse(selectorFlag)
			if err != nil {
				return usagef("-l: selector %q: %v", selectorFlag, err)
			}
			st, err := parseNodeState(state)
			if err != nil {
				return err
			}
			if interval <= 0 {
				return usagef("--watch-interval must be positive")
			}
			s, err := a.dial()
			if err != nil {
				return err
			}
			req := &controlv1.ListNodesRequest{State: st, PoolId: pool, CordonedOnly: cordoned}
			nodes, err := s.listNodes(cmd.Context(), req, sel)
			if err != nil {
				return err
			}
			if err := a.printNodes(nodes); err != nil || !watch {
				return err
			}
			return a.watchNodes(cmd.Context(), s, req, sel, nodes, interval)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&selectorFlag, "selector", "l", "", selectorHelp)
	f.StringVar(&state, "state", "", "only nodes in this state (server side): registered, connected, disconnected, unreachable, revoked")
	f.StringVar(&pool, "pool", "", "only nodes of this pool (server side)")
	f.BoolVar(&cordoned, "cordoned", false, "only cordoned nodes (server side)")
	f.BoolVarP(&watch, "watch", "w", false, "after the list, print nodes as they change until Ctrl-C")
	f.DurationVar(&interval, "watch-interval", 2*time.Second, "how often --watch polls")
	_ = cmd.RegisterFlagCompletionFunc("state", cobra.FixedCompletions([]string{"registered", "connected", "disconnected", "unreachable", "revoked"}, cobra.ShellCompDirectiveNoFileComp))
	return cmd
}

func nodeHeader(wide bool) []string {
	h := []string{"NODE", "STATE", "CORDONED", "LABELS", "LAST SEEN"}
	if wide {
		h = append(h, "POOL", "GATEWAY", "EPOCH", "VERSION", "CREATED")
	}
	return h
}

func nodeRow(now time.Time, n *controlv1.Node, wide bool) []string {
	r := []string{n.GetId(), nodeState(n.GetState()), yesNo(n.GetCordoned()), labelString(n.GetLabels()), age(now, n.GetLastSeenAt())}
	if wide {
		r = append(r, n.GetPoolId(), n.GetGatewayId(), fmt.Sprint(n.GetSessionEpoch()), n.GetDaemonVersion(), timestamp(n.GetCreatedAt()))
	}
	return r
}

func (a *app) printNodes(nodes []*controlv1.Node) error {
	if structured(a.output) {
		return printMessage(a.stdout, a.output, &controlv1.ListNodesResponse{Nodes: nodes})
	}
	wide := a.output == formatWide
	t := newTable(a.stdout, nodeHeader(wide)...)
	now := time.Now()
	for _, n := range nodes {
		t.row(nodeRow(now, n, wide)...)
	}
	return t.flush()
}

// watchNodes polls and prints each node that appeared or whose state,
// cordon, labels, gateway or epoch changed (json/yaml: the node itself).
func (a *app) watchNodes(ctx context.Context, s *session, req *controlv1.ListNodesRequest, sel selector.Selector, last []*controlv1.Node, interval time.Duration) error {
	seen := map[string]string{}
	key := func(n *controlv1.Node) string {
		return fmt.Sprint(n.GetState(), n.GetCordoned(), labelString(n.GetLabels()), n.GetGatewayId(), n.GetSessionEpoch())
	}
	for _, n := range last {
		seen[n.GetId()] = key(n)
	}
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return interrupted
		case <-tick.C:
		}
		nodes, err := s.listNodes(ctx, req, sel)
		if err != nil {
			if ctx.Err() != nil {
				return interrupted
			}
			return err
		}
		now := time.Now()
		wide := a.output == formatWide
		current := map[string]bool{}
		for _, n := range nodes {
			current[n.GetId()] = true
			if seen[n.GetId()] == key(n) {
				continue
			}
			seen[n.GetId()] = key(n)
			if structured(a.output) {
				if err := printMessage(a.stdout, a.output, n); err != nil {
					return err
				}
				continue
			}
			t := newTable(a.stdout)
			t.row(nodeRow(now, n, wide)...)
			if err := t.flush(); err != nil {
				return err
			}
		}
		var gone []string
		for id := range seen {
			if !current[id] {
				gone = append(gone, id)
			}
		}
		sort.Strings(gone)
		for _, id := range gone {
			delete(seen, id)
			if !structured(a.output) {
				_, _ = fmt.Fprintf(a.stdout, "%s\t(no longer listed)\n", id)
			}
		}
	}
}

func (a *app) nodesGetCommand() *cobra.Command {
	return &cobra.Command{
		Use:               "get NODE",
		Short:             "Show one node",
		Args:              exactArgs(1, "NODE"),
		ValidArgsFunction: a.completeNodes,
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := a.dial()
			if err != nil {
				return err
			}
			res, err := s.client.GetNode(cmd.Context(), connect.NewRequest(&controlv1.GetNodeRequest{NodeId: args[0]}))
			if err != nil {
				return s.explain(err)
			}
			if structured(a.output) {
				return printMessage(a.stdout, a.output, res.Msg)
			}
			return a.printNodes([]*controlv1.Node{res.Msg.GetNode()})
		},
	}
}

func (a *app) nodesDescribeCommand() *cobra.Command {
	return &cobra.Command{
		Use:               "describe NODE",
		Short:             "Show one node in full, with its latest commands",
		Args:              exactArgs(1, "NODE"),
		ValidArgsFunction: a.completeNodes,
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := a.dial()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			res, err := s.client.GetNode(ctx, connect.NewRequest(&controlv1.GetNodeRequest{NodeId: args[0]}))
			if err != nil {
				return s.explain(err)
			}
			if structured(a.output) {
				return printMessage(a.stdout, a.output, res.Msg)
			}
			cmds, err := s.client.ListCommands(ctx, connect.NewRequest(&controlv1.ListCommandsRequest{NodeId: args[0], PageSize: 10}))
			if err != nil {
				return s.explain(err)
			}
			n := res.Msg.GetNode()
			now := time.Now()
			t := newTable(a.stdout)
			t.row("Node:", n.GetId())
			t.row("Kind:", enumName(n.GetKind().String(), "NODE_KIND_"))
			t.row("State:", nodeState(n.GetState()))
			t.row("Cordoned:", yesNo(n.GetCordoned())+cordonedSince(n))
			t.row("Labels:", labelString(n.GetLabels()))
			t.row("Pool:", n.GetPoolId())
			t.row("Site:", n.GetSiteId())
			t.row("Gateway:", n.GetGatewayId())
			t.row("Session epoch:", fmt.Sprint(n.GetSessionEpoch()))
			t.row("Agent version:", n.GetDaemonVersion())
			t.row("Last seen:", timestamp(n.GetLastSeenAt())+" ("+age(now, n.GetLastSeenAt())+" ago)")
			t.row("Created:", timestamp(n.GetCreatedAt()))
			t.row("Revoked:", timestamp(n.GetRevokedAt()))
			if err := t.flush(); err != nil {
				return err
			}
			_, _ = fmt.Fprintln(a.stdout, "Latest commands:")
			if len(cmds.Msg.GetCommands()) == 0 {
				_, _ = fmt.Fprintln(a.stdout, "  (none)")
				return nil
			}
			ct := newTable(a.stdout, "  COMMAND", "KIND", "STATE", "AGE")
			for _, c := range cmds.Msg.GetCommands() {
				ct.row("  "+c.GetId(), c.GetKind(), commandState(c.GetState()), age(now, c.GetCreatedAt()))
			}
			return ct.flush()
		},
	}
}

func cordonedSince(n *controlv1.Node) string {
	if !n.GetCordoned() {
		return ""
	}
	return " (since " + timestamp(n.GetCordonedAt()) + ")"
}

func (a *app) cordonCommand() *cobra.Command {
	var reason string
	cmd := &cobra.Command{
		Use:               "cordon NODE",
		Short:             "Stop the placer from allocating NODE to new pool leases (what runs keeps running)",
		Args:              exactArgs(1, "NODE"),
		ValidArgsFunction: a.completeNodes,
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := a.dial()
			if err != nil {
				return err
			}
			res, err := s.client.CordonNode(cmd.Context(), connect.NewRequest(&controlv1.CordonNodeRequest{NodeId: args[0], Reason: reason}))
			if err != nil {
				return s.explain(err)
			}
			if structured(a.output) {
				return printMessage(a.stdout, a.output, res.Msg)
			}
			_, err = fmt.Fprintf(a.stdout, "node/%s cordoned\n", args[0])
			return err
		},
	}
	cmd.Flags().StringVar(&reason, "reason", "", "why, for the audit trail (at most 200 characters)")
	return cmd
}

func (a *app) uncordonCommand() *cobra.Command {
	return &cobra.Command{
		Use:               "uncordon NODE",
		Short:             "Make NODE placeable again",
		Args:              exactArgs(1, "NODE"),
		ValidArgsFunction: a.completeNodes,
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := a.dial()
			if err != nil {
				return err
			}
			res, err := s.client.UncordonNode(cmd.Context(), connect.NewRequest(&controlv1.UncordonNodeRequest{NodeId: args[0]}))
			if err != nil {
				return s.explain(err)
			}
			if structured(a.output) {
				return printMessage(a.stdout, a.output, res.Msg)
			}
			_, err = fmt.Fprintf(a.stdout, "node/%s uncordoned\n", args[0])
			return err
		},
	}
}

// maxDrainWait is the longest wait DrainNode takes in one call.
const maxDrainWait = 60 * time.Second

// drainLoop calls call with the wait left (at most a minute) until done
// says the node is drained or timeout passed; progress says what still runs.
func (a *app) drainLoop(ctx context.Context, node string, timeout time.Duration, call func(wait time.Duration) (done bool, running, leases []string, err error)) error {
	deadline := time.Now().Add(timeout)
	lastShown := ""
	for {
		wait := min(max(time.Until(deadline), 0), maxDrainWait).Truncate(time.Second)
		done, running, leases, err := call(wait)
		if err != nil {
			if ctx.Err() != nil {
				return interrupted
			}
			return err
		}
		if done {
			return nil
		}
		holds := holding(running, leases)
		if !time.Now().Before(deadline) {
			return &exitError{code: exitFailed, msg: fmt.Sprintf("node %s not drained within %s (it stays cordoned): %s", node, timeout, holds)}
		}
		if holds != lastShown {
			_, _ = fmt.Fprintf(a.stderr, "node/%s: waiting for %s\n", node, holds)
			lastShown = holds
		}
		if wait < time.Second {
			select {
			case <-ctx.Done():
				return interrupted
			case <-time.After(time.Second): // pacing of a sub-second remainder
			}
		}
	}
}

// holding says what still holds a node: its commands and pool leases.
func holding(running, leases []string) string {
	var parts []string
	if len(running) > 0 {
		parts = append(parts, "commands "+strings.Join(running, " "))
	}
	if len(leases) > 0 {
		parts = append(parts, "pool leases "+strings.Join(leases, " "))
	}
	if len(parts) == 0 {
		return "nothing listed"
	}
	return strings.Join(parts, "; ")
}

func (a *app) drainCommand() *cobra.Command {
	var reason string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "drain NODE",
		Short: "Cordon NODE and wait until its commands and pool allocations have ended",
		Long: `Cordon NODE, then wait until none of its commands is dispatched or running and
no pool lease holds it, repeating DrainNode (which waits at most a minute per
call) until --timeout. Exit 0 when drained; 1 when the timeout passed first
(the node stays cordoned, and what holds it is printed).`,
		Args:              exactArgs(1, "NODE"),
		ValidArgsFunction: a.completeNodes,
		RunE: func(cmd *cobra.Command, args []string) error {
			if timeout < 0 {
				return usagef("--timeout must not be negative")
			}
			s, err := a.dial()
			if err != nil {
				return err
			}
			var last *controlv1.DrainNodeResponse
			err = a.drainLoop(cmd.Context(), args[0], timeout, func(wait time.Duration) (bool, []string, []string, error) {
				res, err := s.client.DrainNode(cmd.Context(), connect.NewRequest(&controlv1.DrainNodeRequest{NodeId: args[0], Reason: reason, Timeout: durationpb.New(wait)}))
				if err != nil {
					return false, nil, nil, s.explain(err)
				}
				last = res.Msg
				return res.Msg.GetDrained(), res.Msg.GetRunningCommandIds(), res.Msg.GetPoolLeaseIds(), nil
			})
			if err != nil {
				return err
			}
			if structured(a.output) {
				return printMessage(a.stdout, a.output, last)
			}
			_, err = fmt.Fprintf(a.stdout, "node/%s drained\n", args[0])
			return err
		},
	}
	cmd.Flags().StringVar(&reason, "reason", "", "why, for the audit trail")
	cmd.Flags().DurationVar(&timeout, "timeout", 5*time.Minute, "how long to wait for the node's work to end")
	return cmd
}

func (a *app) decommissionCommand() *cobra.Command {
	var reason string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "decommission NODE",
		Short: "Drain NODE and, once drained, revoke its credentials",
		Long: `Drain NODE as drain does (repeating DecommissionNode until --timeout; 0 asks
once) and, once it is drained, revoke its credentials and close its session.
Exit 0 when decommissioned; 1 when still busy (it stays cordoned, unrevoked).`,
		Args:              exactArgs(1, "NODE"),
		ValidArgsFunction: a.completeNodes,
		RunE: func(cmd *cobra.Command, args []string) error {
			if timeout < 0 {
				return usagef("--timeout must not be negative")
			}
			s, err := a.dial()
			if err != nil {
				return err
			}
			var last *controlv1.DecommissionNodeResponse
			err = a.drainLoop(cmd.Context(), args[0], timeout, func(wait time.Duration) (bool, []string, []string, error) {
				res, err := s.client.DecommissionNode(cmd.Context(), connect.NewRequest(&controlv1.DecommissionNodeRequest{NodeId: args[0], Reason: reason, Timeout: durationpb.New(wait)}))
				if err != nil {
					return false, nil, nil, s.explain(err)
				}
				last = res.Msg
				return res.Msg.GetDecommissioned(), res.Msg.GetRunningCommandIds(), res.Msg.GetPoolLeaseIds(), nil
			})
			if err != nil {
				return err
			}
			if structured(a.output) {
				return printMessage(a.stdout, a.output, last)
			}
			_, err = fmt.Fprintf(a.stdout, "node/%s decommissioned: credentials revoked\n", args[0])
			return err
		},
	}
	cmd.Flags().StringVar(&reason, "reason", "", "why, for the audit trail")
	cmd.Flags().DurationVar(&timeout, "timeout", 0, "how long to wait for the node's work to end (0: ask once)")
	return cmd
}

// completeNodes completes node ids from ListNodes.
func (a *app) completeNodes(cmd *cobra.Command, _ []string, prefix string) ([]string, cobra.ShellCompDirective) {
	s, err := a.dial()
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp | cobra.ShellCompDirectiveError
	}
	ctx, cancel := context.WithTimeout(cmd.Context(), 5*time.Second)
	defer cancel()
	nodes, err := s.listNodes(ctx, &controlv1.ListNodesRequest{}, selector.Selector{})
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp | cobra.ShellCompDirectiveError
	}
	var ids []string
	for _, n := range nodes {
		if strings.HasPrefix(n.GetId(), prefix) {
			ids = append(ids, n.GetId())
		}
	}
	return ids, cobra.ShellCompDirectiveNoFileComp
}
