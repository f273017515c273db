package buildinfo

import (
	"runtime"
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestResolveFallbacks(t *testing.T) {
	t.Parallel()
	vcs := &debug.BuildInfo{GoVersion: "go1.99", Main: debug.Module{Version: "(devel)"},
		Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "abc123"}, {Key: "vcs.modified", Value: "true"}}}
	cases := []struct {
		name              string
		version, revision string
		bi                *debug.BuildInfo
		want              Info
	}{
		{"stamped wins", "v1.2.3", "deadbeef", vcs, Info{"v1.2.3", "deadbeef", "go1.99"}},
		{"vcs fallback", "", "", vcs, Info{UnknownVersion, "abc123-dirty", "go1.99"}},
		{"module version", "", "", &debug.BuildInfo{Main: debug.Module{Version: "v0.4.0"}}, Info{"v0.4.0", UnknownRevision, runtime.Version()}},
		{"nothing known", "", "", nil, Info{UnknownVersion, UnknownRevision, runtime.Version()}},
	}
	for _, c := range cases {
		require.Equal(t, c.want, resolve(c.version, c.revision, c.bi), c.name)
	}
}

func TestStringNamesTheBuild(t *testing.T) {
	t.Parallel()
	i := Get()
	require.Equal(t, "x "+i.Version+" (revision "+i.Revision+", "+i.GoVersion+")", String("x"))
}
