package process

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/leasehold/leasehold/pkg/buildinfo"
	"github.com/leasehold/leasehold/pkg/health"
)

// VersionFlag is the flag that prints the build and exits 0. It has no
// LEASEHOLD_* environment fallback: an environment variable must never
// turn a service into a command that prints and exits.
const VersionFlag = "version"

// noEnv lists the flags ApplyEnv never sets from the environment.
var noEnv = map[string]bool{VersionFlag: true}

// RegisterVersionFlag registers --version on fs; when the returned flag is
// set after parsing, call PrintVersion and exit 0 before any other work.
func RegisterVersionFlag(fs *flag.FlagSet) *bool {
	return fs.Bool(VersionFlag, false, "print the version, VCS revision and Go version, and exit")
}

// PrintVersion writes "leasehold-<name> <version> (revision …, go…)" to w.
func PrintVersion(w io.Writer, name string) {
	fmt.Fprintln(w, buildinfo.String("leasehold-"+name))
}

// RegisterBuildInfo adds the leasehold_build_info gauge to reg and a
// "build" section (version, revision, goversion) to /healthz/detail.
func RegisterBuildInfo(reg prometheus.Registerer, h *health.Handler) {
	reg.MustRegister(buildinfo.NewCollector())
	h.AddDetail("build", func(context.Context) any { return buildinfo.Get() })
}
