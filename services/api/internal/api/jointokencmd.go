package api

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/user"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/leasehold/leasehold/pkg/apiauth"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/pgdb"
)

const joinTokenUsage = `usage: leasehold-api join-token create|ls|revoke [flags]

  create [--ttl 24h] [--uses 1] [--label k=v]... [--pool id] [--description text]
        prints the new token on the first line (hand it to the machines:
        leasehold-node join), then a summary; the token is not shown again
  ls [--all]
        lists the tokens a join would accept now (--all: every token)
  revoke <id>
        makes the token with that id unusable

Every subcommand takes --database-url (env LEASEHOLD_DATABASE_URL) and
--pooler (env LEASEHOLD_POOLER, when the URL goes through PgBouncer in
transaction mode), and acts as an admin: it runs the same code as
ControlService's CreateJoinToken, ListJoinTokens and RevokeJoinToken, audit
rows included (actor "cli:<user>").
`

// JoinTokenCommand runs `leasehold-api join-token <args>` against the
// database and returns the exit status: 0 done, 2 bad usage or a refused
// flag (the message names the flag), 1 when the database failed. It goes
// through the ControlService handlers themselves (validation, transaction,
// audit), so the command and the RPCs cannot disagree.
func JoinTokenCommand(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, joinTokenUsage)
		return 2
	}
	switch args[0] {
	case "-h", "--help", "help":
		fmt.Fprint(stdout, joinTokenUsage)
		return 0
	case "create", "ls", "revoke":
	default:
		fmt.Fprintf(stderr, "leasehold-api join-token: unknown subcommand %q\n%s", args[0], joinTokenUsage)
		return 2
	}
	sub := args[0]
	name := "leasehold-api join-token " + sub
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	dbURL := fs.String("database-url", "", "PostgreSQL URL (env LEASEHOLD_DATABASE_URL)")
	pooler := fs.Bool("pooler", false, "--database-url goes through PgBouncer in transaction mode (env LEASEHOLD_POOLER)")
	var (
		ttl    = fs.Duration("ttl", defaultJoinTokenTTL, "how long the token works (1m..720h)")
		uses   = fs.Int("uses", 1, "how many joins it allows (1..100000)")
		pool   = fs.String("pool", "", "existing pool every node that joins belongs to")
		desc   = fs.String("description", "", "free text (at most 200 bytes)")
		labels = labelFlag{}
		all    = fs.Bool("all", false, "ls: also expired, used-up and revoked tokens")
	)
	fs.Var(labels, "label", "k=v label of every node that joins (repeatable)")
	// Flags may come before or after the arguments (revoke <id> --database-url …).
	var pos []string
	for rest := args[1:]; ; {
		if err := fs.Parse(rest); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return 0
			}
			return 2
		}
		if fs.NArg() == 0 {
			break
		}
		pos, rest = append(pos, fs.Arg(0)), fs.Args()[1:]
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	for flagName, allowed := range map[string]bool{"ttl": sub == "create", "uses": sub == "create", "pool": sub == "create",
		"description": sub == "create", "label": sub == "create", "all": sub == "ls"} {
		if given[flagName] && !allowed {
			fmt.Fprintf(stderr, "%s: --%s does not apply to %s\n", name, flagName, sub)
			return 2
		}
	}
	var id string
	switch {
	case sub == "revoke" && len(pos) != 1:
		fmt.Fprintf(stderr, "%s: give exactly one token id\n", name)
		return 2
	case sub == "revoke":
		id = pos[0]
	case len(pos) > 0:
		fmt.Fprintf(stderr, "%s: unexpected arguments %q\n", name, pos)
		return 2
	}
	if !given["database-url"] {
		*dbURL = os.Getenv("LEASEHOLD_DATABASE_URL")
	}
	if v, ok := os.LookupEnv("LEASEHOLD_POOLER"); ok && !given["pooler"] {
		*pooler = v == "true" || v == "1"
	}
	if *dbURL == "" {
		fmt.Fprintf(stderr, "%s: --database-url (LEASEHOLD_DATABASE_URL) is required\n", name)
		return 2
	}
	var req *controlv1.CreateJoinTokenRequest
	if sub == "create" {
		if *uses < 1 || *uses > maxJoinTokenUses {
			fmt.Fprintf(stderr, "%s: --uses must be in 1..%d, got %d\n", name, maxJoinTokenUses, *uses)
			return 2
		}
		req = &controlv1.CreateJoinTokenRequest{Ttl: durationpb.New(*ttl), MaxUses: int32(*uses), Labels: labels,
			PoolId: *pool, Description: *desc}
		// The handler validates again; this is to name the flag.
		if _, err := validateCreateJoinToken(req); err != nil {
			fmt.Fprintf(stderr, "%s: %s\n", name, flagMessage(err))
			return 2
		}
	}
	if sub == "revoke" {
		if err := checkRE("id", id, joinTokenIDRE); err != nil {
			fmt.Fprintf(stderr, "%s: %s\n", name, flagMessage(err))
			return 2
		}
	}

	db, err := pgdb.Connect(ctx, pgdb.Config{URL: *dbURL, AppName: "leasehold-api:join-token", MaxConns: 2, Pooler: *pooler,
		Setting: "--database-url"})
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", name, err)
		return 1
	}
	defer db.Close()
	h, ctx := cliHandler(ctx, db, stderr)
	switch sub {
	case "create":
		resp, err := h.CreateJoinToken(ctx, connect.NewRequest(req))
		if err != nil {
			return cliFailed(stderr, name, err)
		}
		fmt.Fprintln(stdout, resp.Msg.GetToken())
		t := resp.Msg.GetJoinToken()
		fmt.Fprintf(stdout, "id %s: %d use(s) until %s", t.GetId(), t.GetMaxUses(), t.GetExpiresAt().AsTime().UTC().Format(time.RFC3339))
		if t.GetPoolId() != "" {
			fmt.Fprintf(stdout, ", pool %s", t.GetPoolId())
		}
		if len(t.GetLabels()) > 0 {
			fmt.Fprintf(stdout, ", labels %s", formatLabels(t.GetLabels()))
		}
		fmt.Fprintln(stdout)
		fmt.Fprintln(stdout, "the token is shown only now; a machine joins with: leasehold-node join --token <token>")
	case "ls":
		resp, err := h.ListJoinTokens(ctx, connect.NewRequest(&controlv1.ListJoinTokensRequest{IncludeInactive: *all}))
		if err != nil {
			return cliFailed(stderr, name, err)
		}
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tUSES\tEXPIRES\tSTATE\tPOOL\tLABELS\tDESCRIPTION")
		// Expired by the database clock, as Join judges it.
		now, err := pgdb.Now(ctx, db)
		if err != nil {
			return cliFailed(stderr, name, err)
		}
		for _, t := range resp.Msg.GetJoinTokens() {
			state := "active"
			switch {
			case t.GetRevokedAt() != nil:
				state = "revoked"
			case t.GetUses() >= t.GetMaxUses():
				state = "used-up"
			case !t.GetExpiresAt().AsTime().After(now):
				state = "expired"
			}
			fmt.Fprintf(tw, "%s\t%d/%d\t%s\t%s\t%s\t%s\t%s\n", t.GetId(), t.GetUses(), t.GetMaxUses(),
				t.GetExpiresAt().AsTime().UTC().Format(time.RFC3339), state, dash(t.GetPoolId()), dash(formatLabels(t.GetLabels())),
				t.GetDescription())
		}
		if err := tw.Flush(); err != nil {
			fmt.Fprintf(stderr, "%s: %v\n", name, err)
			return 1
		}
	case "revoke":
		resp, err := h.RevokeJoinToken(ctx, connect.NewRequest(&controlv1.RevokeJoinTokenRequest{Id: id}))
		if err != nil {
			return cliFailed(stderr, name, err)
		}
		fmt.Fprintf(stdout, "join token %s revoked at %s\n", id, resp.Msg.GetJoinToken().GetRevokedAt().AsTime().UTC().Format(time.RFC3339))
	}
	return 0
}

// cliHandler is a Handler on db for the command, and a context that makes
// the caller an admin named "cli:<user>" in the audit trail.
func cliHandler(ctx context.Context, db *pgxpool.Pool, stderr io.Writer) (*Handler, context.Context) {
	who := "unknown"
	if u, err := user.Current(); err == nil && u.Username != "" {
		who = u.Username
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	return &Handler{db: db, log: log}, context.WithValue(ctx, identityKey{}, apiauth.Identity{ID: "cli:" + who, Role: apiauth.RoleAdmin})
}

// cliFlags maps request fields to the command's flags.
var cliFlags = map[string]string{"ttl": "--ttl", "max_uses": "--uses", "labels": "--label", "pool_id": "--pool",
	"description": "--description", "id": "<id>"}

// flagMessage is a validation error's message with its field named as the
// flag that set it.
func flagMessage(err error) string {
	msg := connectMessage(err)
	for field, fl := range cliFlags {
		if rest, ok := strings.CutPrefix(msg, field); ok && (strings.HasPrefix(rest, ":") || strings.HasPrefix(rest, "[")) {
			return fl + rest
		}
	}
	return msg
}

func connectMessage(err error) string {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Message()
	}
	return err.Error()
}

// cliFailed reports a handler's error: a refused argument (a pool that
// does not exist, an unknown id) exits 2 naming its flag, anything else 1.
func cliFailed(stderr io.Writer, name string, err error) int {
	fmt.Fprintf(stderr, "%s: %s\n", name, flagMessage(err))
	switch connect.CodeOf(err) {
	case connect.CodeInvalidArgument, connect.CodeNotFound:
		return 2
	}
	return 1
}

func formatLabels(m map[string]string) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + m[k]
	}
	return strings.Join(parts, ",")
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// labelFlag collects repeated --label k=v.
type labelFlag map[string]string

func (l labelFlag) String() string { return formatLabels(l) }

func (l labelFlag) Set(v string) error {
	k, val, ok := strings.Cut(v, "=")
	if !ok || k == "" {
		return fmt.Errorf("want key=value, got %q", v)
	}
	if _, dup := l[k]; dup {
		return fmt.Errorf("label %q given twice", k)
	}
	l[k] = val
	return nil
}
