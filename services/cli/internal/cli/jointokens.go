package cli

import (
	"fmt"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/durationpb"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/selector"
)

func (a *app) joinTokensCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:     "join-tokens",
		Aliases: []string{"join-token"},
		Short:   "Create, list and revoke join tokens (admin)",
		Long: `A join token is a secret a machine exchanges for its own node credential
(leasehold-node join; docs/node.md). create prints the token once, on its
first line; it is never shown again.`,
	}
	cmd.AddCommand(a.joinTokensCreateCommand(), a.joinTokensLsCommand(), a.joinTokensRevokeCommand())
	return cmd
}

// parseLabels parses repeated k=v flags.
func parseLabels(flag string, kvs []string) (map[string]string, error) {
	if len(kvs) == 0 {
		return nil, nil
	}
	out := map[string]string{}
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || !selector.ValidKey(k) {
			return nil, usagef("%s %q: want key=value with a key matching %s", flag, kv, selector.KeyPattern)
		}
		out[k] = v
	}
	return out, nil
}

func (a *app) joinTokensCreateCommand() *cobra.Command {
	var ttl time.Duration
	var uses int
	var labels []string
	var pool, description string
	cmd := &cobra.Command{
		Use:   "create [--ttl D] [--uses N] [--label k=v]... [--pool P] [--description TEXT]",
		Short: "Create a join token; its secret is printed once, on the first line",
		Args:  exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if ttl < time.Minute || ttl > 30*24*time.Hour {
				return usagef("--ttl %s: must be between 1m and 720h (30 days)", ttl)
			}
			if uses < 1 || uses > 100000 {
				return usagef("--uses %d: must be between 1 and 100000", uses)
			}
			lbl, err := parseLabels("--label", labels)
			if err != nil {
				return err
			}
			s, err := a.dial()
			if err != nil {
				return err
			}
			res, err := s.client.CreateJoinToken(cmd.Context(), connect.NewRequest(&controlv1.CreateJoinTokenRequest{
				Ttl: durationpb.New(ttl), MaxUses: int32(uses), Labels: lbl, PoolId: pool, Description: description}))
			if err != nil {
				return s.explain(err)
			}
			if structured(a.output) {
				return printMessage(a.stdout, a.output, res.Msg)
			}
			jt := res.Msg.GetJoinToken()
			_, err = fmt.Fprintf(a.stdout, "%s\njoin token %s: %d use(s), expires %s, labels %s, pool %s\n",
				res.Msg.GetToken(), jt.GetId(), jt.GetMaxUses(), timestamp(jt.GetExpiresAt()), labelString(jt.GetLabels()), dash(jt.GetPoolId()))
			return err
		},
	}
	f := cmd.Flags()
	f.DurationVar(&ttl, "ttl", 24*time.Hour, "how long the token works (1m..720h)")
	f.IntVar(&uses, "uses", 1, "how many machines may join with it (1..100000)")
	f.StringArrayVar(&labels, "label", nil, "a label k=v every node joining with it gets (repeatable)")
	f.StringVar(&pool, "pool", "", "an existing pool every node joining with it belongs to")
	f.StringVar(&description, "description", "", "free text for operators (at most 200 bytes)")
	return cmd
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func (a *app) joinTokensLsCommand() *cobra.Command {
	var all bool
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List join tokens (never their secrets), newest first",
		Args:    exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			s, err := a.dial()
			if err != nil {
				return err
			}
			res, err := s.client.ListJoinTokens(cmd.Context(), connect.NewRequest(&controlv1.ListJoinTokensRequest{IncludeInactive: all}))
			if err != nil {
				return s.explain(err)
			}
			if structured(a.output) {
				return printMessage(a.stdout, a.output, res.Msg)
			}
			wide := a.output == formatWide
			h := []string{"ID", "USES", "EXPIRES", "STATUS", "LABELS", "POOL"}
			if wide {
				h = append(h, "CREATED", "EXPIRES AT", "DESCRIPTION")
			}
			t := newTable(a.stdout, h...)
			now := time.Now()
			for _, jt := range res.Msg.GetJoinTokens() {
				status := "active"
				switch {
				case jt.GetRevokedAt() != nil:
					status = "revoked"
				case jt.GetUses() >= jt.GetMaxUses():
					status = "used up"
				case jt.GetExpiresAt() != nil && !jt.GetExpiresAt().AsTime().After(now):
					status = "expired"
				}
				r := []string{jt.GetId(), fmt.Sprintf("%d/%d", jt.GetUses(), jt.GetMaxUses()), until(now, jt.GetExpiresAt()), status, labelString(jt.GetLabels()), jt.GetPoolId()}
				if wide {
					r = append(r, timestamp(jt.GetCreatedAt()), timestamp(jt.GetExpiresAt()), jt.GetDescription())
				}
				t.row(r...)
			}
			return t.flush()
		},
	}
	cmd.Flags().BoolVar(&all, "all", false, "also expired, used-up and revoked tokens")
	return cmd
}

func (a *app) joinTokensRevokeCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "revoke ID",
		Short: "Make a join token unusable (revoking twice is not an error)",
		Args:  exactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := a.dial()
			if err != nil {
				return err
			}
			res, err := s.client.RevokeJoinToken(cmd.Context(), connect.NewRequest(&controlv1.RevokeJoinTokenRequest{Id: args[0]}))
			if err != nil {
				return s.explain(err)
			}
			if structured(a.output) {
				return printMessage(a.stdout, a.output, res.Msg)
			}
			_, err = fmt.Fprintf(a.stdout, "join token %s revoked\n", args[0])
			return err
		},
	}
}
