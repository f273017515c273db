// Command leasehold-doctor reports findings about a leasehold deployment from
// its database: `leasehold-doctor [check]` prints them and exits 0 ok, 1 warn,
// 2 critical; `leasehold-doctor serve` serves DoctorService and one
// Prometheus gauge per finding. See docs/doctor.md.
//
// Flags fall back to LEASEHOLD_* environment variables; serve stops
// gracefully on SIGTERM.
package main

import (
	"context"
	"os"

	"github.com/leasehold/leasehold/services/doctor/internal/cli"
)

func main() {
	os.Exit(cli.Main(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
}
