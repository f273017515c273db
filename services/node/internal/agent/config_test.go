package agent

import (
	"flag"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/nodeexec"
)

// TestResolveExecCgroup: --exec.cgroup is auto by default; required on a
// machine where commands cannot run in cgroups of their own is refused at
// Resolve, naming the flag and the reason, before any credential is read.
func TestResolveExecCgroup(t *testing.T) {
	var c Config
	fs := flag.NewFlagSet("node", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	c.RegisterFlags(fs)
	require.Equal(t, nodeexec.CgroupAuto, c.Exec.Cgroup)
	require.Error(t, fs.Parse([]string{"--exec.cgroup=sometimes"}))

	state := t.TempDir()
	require.NoError(t, fs.Parse([]string{"--state-dir", state, "--node-id", "n1", "--exec.cgroup=required"}))
	reason := nodeexec.CheckCgroups(c.Exec)
	if reason == nil {
		t.Skip("commands can run in cgroups of their own here (a cgroup v2 of this test's own): nothing to refuse")
	}
	err := c.Resolve()
	require.Error(t, err)
	// The reason may count the processes of a shared cgroup, which come
	// and go between the two checks.
	count := regexp.MustCompile(`\(\d+, `)
	require.Contains(t, count.ReplaceAllString(err.Error(), "(N, "), "--exec.cgroup=required: "+count.ReplaceAllString(reason.Error(), "(N, "))

	// With a credential, and off, it resolves.
	require.NoError(t, os.WriteFile(filepath.Join(state, credentialFileName), []byte("lhn_x\n"), 0o600))
	require.NoError(t, fs.Parse([]string{"--exec.cgroup=off"}))
	require.NoError(t, c.Resolve())
}
