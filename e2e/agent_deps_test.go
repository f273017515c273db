package e2e

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestAgentsLinkNoDatabaseOrExporter: the programs that run on every
// machine (leasehold-node, leasehold-site-agent) link no database driver,
// no migrations and no OpenTelemetry exporter. Each would add megabytes of
// pages the agent touches at start (the idle RSS target is 15 MiB) and code
// a node never runs; pkg/lifecycle and pkg/nodeauth exist so they need not.
func TestAgentsLinkNoDatabaseOrExporter(t *testing.T) {
	t.Parallel()
	forbidden := []string{
		"github.com/jackc/pgx", "github.com/pressly/goose", "github.com/leasehold/leasehold/migrations",
		"go.opentelemetry.io/otel/exporters", "google.golang.org/grpc",
	}
	for _, dir := range []string{"../services/node", "../services/site-agent"} {
		out, err := exec.Command("go", "list", "-C", dir, "-deps", ".").CombinedOutput()
		require.NoError(t, err, "%s", out)
		for _, pkg := range strings.Fields(string(out)) {
			for _, f := range forbidden {
				require.False(t, strings.HasPrefix(pkg, f), "%s links %s", dir, pkg)
			}
		}
	}
}
