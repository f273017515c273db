package lifecycle

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

// BuildInfoMetric is the build gauge's name.
const BuildInfoMetric = "leasehold_build_info"

// NewBuildInfoCollector returns the gauge leasehold_build_info{version,
// revision,goversion}, always 1: join it on other series to label them
// with the build (`* on(instance) group_left(version)`). It lives here, not
// in pkg/buildinfo, so the node-side pkg/daemon reads the version without
// the Prometheus client.
func NewBuildInfoCollector() prometheus.Collector {
	i := buildinfo.Get()
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: BuildInfoMetric,
		Help: "A constant 1 labelled with the running build's version, VCS revision and Go version.",
		ConstLabels: prometheus.Labels{
			"version": i.Version, "revision": i.Revision, "goversion": i.GoVersion,
		},
	}, func() float64 { return 1 })
}

// RegisterBuildInfo adds the leasehold_build_info gauge to reg and a
// "build" section (version, revision, goversion) to /healthz/detail.
func RegisterBuildInfo(reg prometheus.Registerer, h *health.Handler) {
	reg.MustRegister(NewBuildInfoCollector())
	h.AddDetail("build", func(context.Context) any { return buildinfo.Get() })
}
