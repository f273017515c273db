package cli

import (
	"fmt"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/leasehold/leasehold/pkg/apiauth"
)

// tokensCommand makes API tokens. They live in the api replicas' tokens
// file (docs/api.md, "Authentication"), not in the database, so creating
// one is local: a random token and the line that grants its role without
// holding it in clear. No context is needed.
func (a *app) tokensCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:     "tokens",
		Aliases: []string{"token"},
		Short:   "Create API tokens for the api's tokens file",
	}
	cmd.AddCommand(a.tokensCreateCommand())
	return cmd
}

func (a *app) tokensCreateCommand() *cobra.Command {
	var roleName string
	cmd := &cobra.Command{
		Use:   "create --role viewer|operator|tunnel|admin",
		Short: "Print a new API token and the tokens-file line that gives it its role",
		Long: `Prints a new API token (crypto/rand, 256 bits) on the first line and, on the
second, the line that gives it the role in the api's --tokens-file (or
LEASEHOLD_API_TOKENS) without holding it in clear ("role:sha256:<hex>").
Append the second line to the tokens file of every api replica (re-read
within --api.reload-interval, no restart); hand the token to its user once.
Nothing is sent anywhere.`,
		Args: exactArgs(0, "no arguments"),
		RunE: func(_ *cobra.Command, _ []string) error {
			if roleName == "" {
				return usagef("--role is required (viewer, operator, tunnel or admin)")
			}
			role, err := apiauth.ParseRole(roleName)
			if err != nil {
				return usagef("--role %q: %v", roleName, err)
			}
			token, err := apiauth.GenerateToken()
			if err != nil {
				return err
			}
			line := apiauth.ConfigLine(role, token)
			if structured(a.output) {
				m, err := structpb.NewStruct(map[string]any{"token": token, "role": role.String(), "tokensFileLine": line})
				if err != nil {
					return fmt.Errorf("encode the token: %w", err)
				}
				return printMessage(a.stdout, a.output, m)
			}
			_, err = fmt.Fprintf(a.stdout, "%s\n%s\n", token, line)
			return err
		},
	}
	cmd.Flags().StringVar(&roleName, "role", "", "role of the new token: viewer, operator, tunnel or admin (required)")
	_ = cmd.RegisterFlagCompletionFunc("role", cobra.FixedCompletions([]string{"viewer", "operator", "tunnel", "admin"}, cobra.ShellCompDirectiveNoFileComp))
	return cmd
}
