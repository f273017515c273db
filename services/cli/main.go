// Command leasehold is the operator CLI of a leasehold fleet: contexts,
// nodes, commands and their logs, runs across nodes, shells and port
// forwards through tunnels, join tokens and the coordination views, all
// through leasehold-api's ControlService. See docs/cli.md.
package main

import (
	"os"

	"github.com/leasehold/leasehold/services/cli/internal/cli"
)

func main() {
	os.Exit(cli.Main(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}
