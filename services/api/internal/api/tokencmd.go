package api

import (
	"errors"
	"flag"
	"fmt"
	"io"

	"github.com/leasehold/leasehold/pkg/apiauth"
)

const tokenUsage = `usage: leasehold-api token create --role viewer|operator|admin

Prints a new API token (crypto/rand, 256 bits) on the first line and, on the
second, the line that gives it the role in --tokens-file or
LEASEHOLD_API_TOKENS without holding it in clear ("role:sha256:<hex>").
Hand the token to its user once; keep only the second line.
`

// TokenCommand runs `leasehold-api token <args>` and returns the exit
// status: 0 done, 2 bad usage, 1 when no randomness could be had. It needs
// no database and no configuration.
func TokenCommand(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] != "create" {
		fmt.Fprint(stderr, tokenUsage)
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help" || args[0] == "help") {
			return 0
		}
		return 2
	}
	fs := flag.NewFlagSet("leasehold-api token create", flag.ContinueOnError)
	fs.SetOutput(stderr)
	roleName := fs.String("role", "", "role of the new token: viewer, operator, tunnel or admin (required)")
	if err := fs.Parse(args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "leasehold-api token create: unexpected arguments %q\n", fs.Args())
		return 2
	}
	if *roleName == "" {
		fmt.Fprintln(stderr, "leasehold-api token create: --role is required (viewer, operator, tunnel or admin)")
		return 2
	}
	role, err := apiauth.ParseRole(*roleName)
	if err != nil {
		fmt.Fprintf(stderr, "leasehold-api token create: --role: %v\n", err)
		return 2
	}
	token, err := apiauth.GenerateToken()
	if err != nil {
		fmt.Fprintf(stderr, "leasehold-api token create: %v\n", err)
		return 1
	}
	fmt.Fprintln(stdout, token)
	fmt.Fprintln(stdout, apiauth.ConfigLine(role, token))
	return 0
}
