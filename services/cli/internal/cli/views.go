package cli

import (
	"bytes"
	"encoding/json"
	"fmt"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
)

func (a *app) leasesCommand() *cobra.Command {
	var prefix string
	cmd := &cobra.Command{
		Use:   "leases",
		Short: "List coordination leases (read-only): owner, epoch, expiry",
		Args:  exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			s, err := a.dial()
			if err != nil {
				return err
			}
			all := &controlv1.ListLeasesResponse{}
			req := &controlv1.ListLeasesRequest{PageSize: 1000, NamePrefix: prefix}
			for {
				res, err := s.client.ListLeases(cmd.Context(), connect.NewRequest(req))
				if err != nil {
					return s.explain(err)
				}
				all.Leases = append(all.Leases, res.Msg.GetLeases()...)
				if req.PageToken = res.Msg.GetNextPageToken(); req.PageToken == "" {
					break
				}
			}
			if structured(a.output) {
				return printMessage(a.stdout, a.output, all)
			}
			wide := a.output == formatWide
			h := []string{"LEASE", "OWNER", "EPOCH", "EXPIRES"}
			if wide {
				h = append(h, "EXPIRES AT")
			}
			t := newTable(a.stdout, h...)
			now := time.Now()
			for _, l := range all.GetLeases() {
				exp := until(now, l.GetExpiresAt())
				if l.GetExpired() {
					exp = "expired"
				}
				r := []string{l.GetName(), l.GetOwner(), fmt.Sprint(l.GetEpoch()), exp}
				if wide {
					r = append(r, timestamp(l.GetExpiresAt()))
				}
				t.row(r...)
			}
			return t.flush()
		},
	}
	cmd.Flags().StringVar(&prefix, "prefix", "", `only leases whose name starts with this, e.g. "gateway:"`)
	return cmd
}

func (a *app) workersCommand() *cobra.Command {
	var group string
	cmd := &cobra.Command{
		Use:   "workers",
		Short: "List worker processes from the membership table",
		Args:  exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			s, err := a.dial()
			if err != nil {
				return err
			}
			res, err := s.client.ListWorkers(cmd.Context(), connect.NewRequest(&controlv1.ListWorkersRequest{Group: group}))
			if err != nil {
				return s.explain(err)
			}
			if structured(a.output) {
				return printMessage(a.stdout, a.output, res.Msg)
			}
			wide := a.output == formatWide
			h := []string{"WORKER", "GROUP", "LIVE", "HEARTBEAT"}
			if wide {
				h = append(h, "CLOCK SKEW", "HEARTBEAT AT")
			}
			t := newTable(a.stdout, h...)
			now := time.Now()
			for _, w := range res.Msg.GetWorkers() {
				r := []string{w.GetId(), w.GetGroup(), yesNo(w.GetLive()), age(now, w.GetHeartbeatAt())}
				if wide {
					r = append(r, durationString(w.GetClockSkew()), timestamp(w.GetHeartbeatAt()))
				}
				t.row(r...)
			}
			return t.flush()
		},
	}
	cmd.Flags().StringVar(&group, "group", "", `only workers of this group, e.g. "controllers"`)
	return cmd
}

func (a *app) gatewaysCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "gateways",
		Short: "List gateways and their node sessions",
		Args:  exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			s, err := a.dial()
			if err != nil {
				return err
			}
			res, err := s.client.ListGateways(cmd.Context(), connect.NewRequest(&controlv1.ListGatewaysRequest{}))
			if err != nil {
				return s.explain(err)
			}
			if structured(a.output) {
				return printMessage(a.stdout, a.output, res.Msg)
			}
			wide := a.output == formatWide
			h := []string{"GATEWAY", "LIVE", "SESSIONS", "LEASE EPOCH", "LEASE EXPIRES"}
			if wide {
				h = append(h, "LEASE EXPIRES AT")
			}
			t := newTable(a.stdout, h...)
			now := time.Now()
			for _, g := range res.Msg.GetGateways() {
				r := []string{g.GetId(), yesNo(g.GetLive()), fmt.Sprint(g.GetSessions()), fmt.Sprint(g.GetLeaseEpoch()), until(now, g.GetLeaseExpiresAt())}
				if wide {
					r = append(r, timestamp(g.GetLeaseExpiresAt()))
				}
				t.row(r...)
			}
			return t.flush()
		},
	}
}

func (a *app) auditCommand() *cobra.Command {
	var limit int
	var method, actor, targetKind, targetID string
	cmd := &cobra.Command{
		Use:   "audit",
		Short: "Show the audit trail, newest first (admin)",
		Args:  exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if limit < 1 {
				return usagef("--limit must be at least 1")
			}
			if targetID != "" && targetKind == "" {
				return usagef("--target-id needs --target-kind")
			}
			s, err := a.dial()
			if err != nil {
				return err
			}
			all := &controlv1.ListAuditEventsResponse{}
			req := &controlv1.ListAuditEventsRequest{Method: method, Actor: actor, TargetKind: targetKind, TargetId: targetID}
			for len(all.Events) < limit {
				req.PageSize = int32(min(limit-len(all.Events), 1000))
				res, err := s.client.ListAuditEvents(cmd.Context(), connect.NewRequest(req))
				if err != nil {
					return s.explain(err)
				}
				all.Events = append(all.Events, res.Msg.GetEvents()...)
				if req.PageToken = res.Msg.GetNextPageToken(); req.PageToken == "" {
					break
				}
			}
			if len(all.Events) > limit {
				all.Events = all.Events[:limit]
			}
			if structured(a.output) {
				return printMessage(a.stdout, a.output, all)
			}
			wide := a.output == formatWide
			h := []string{"ID", "AGE", "ACTOR", "ROLE", "METHOD", "TARGET", "OUTCOME"}
			if wide {
				h = append(h, "AT", "DETAIL")
			}
			t := newTable(a.stdout, h...)
			now := time.Now()
			for _, e := range all.GetEvents() {
				r := []string{fmt.Sprint(e.GetId()), age(now, e.GetAt()), e.GetActor(), e.GetRole(), e.GetMethod(), e.GetTargetKind() + "/" + e.GetTargetId(), e.GetOutcome()}
				if wide {
					detail := "-"
					if e.GetDetail() != nil {
						if b, err := e.GetDetail().MarshalJSON(); err == nil {
							// protojson's spacing is deliberately unstable: compact it.
							var c bytes.Buffer
							if json.Compact(&c, b) == nil {
								detail = c.String()
							}
						}
					}
					r = append(r, timestamp(e.GetAt()), detail)
				}
				t.row(r...)
			}
			return t.flush()
		},
	}
	f := cmd.Flags()
	f.IntVar(&limit, "limit", 50, "how many events at most")
	f.StringVar(&method, "method", "", "only events of this method, e.g. CordonNode or tunnel.open")
	f.StringVar(&actor, "actor", "", "only events of this caller (sha256:<12 hex>)")
	f.StringVar(&targetKind, "target-kind", "", "only events about this kind of target: node, command, pool, pool_lease, sink, join_token")
	f.StringVar(&targetID, "target-id", "", "only events about this target (needs --target-kind)")
	return cmd
}
