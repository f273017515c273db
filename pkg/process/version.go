package process

import (
	"flag"
	"io"

	"github.com/leasehold/leasehold/pkg/lifecycle"
)

// VersionFlag is lifecycle.VersionFlag: --version prints the build and
// exits 0, and has no environment fallback.
const VersionFlag = lifecycle.VersionFlag

// BuildInfoMetric is lifecycle.BuildInfoMetric, the build gauge's name.
const BuildInfoMetric = lifecycle.BuildInfoMetric

// RegisterVersionFlag is lifecycle.RegisterVersionFlag.
func RegisterVersionFlag(fs *flag.FlagSet) *bool { return lifecycle.RegisterVersionFlag(fs) }

// PrintVersion is lifecycle.PrintVersion: "leasehold-<name> <version> …".
func PrintVersion(w io.Writer, name string) { lifecycle.PrintVersion(w, name) }
