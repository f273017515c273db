package buildinfo

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestRelease: the release of a version string, as the gateway's minimum
// daemon version and doctor's version histogram compare it.
func TestRelease(t *testing.T) {
	t.Parallel()
	cases := []struct{ in, want string }{
		{"v1.2.3", "v1.2.3"},
		{"1.2.3", "v1.2.3"},
		{"v1.2", "v1.2.0"},
		{"2", "v2.0.0"},
		{" v1.0.0 ", "v1.0.0"},
		{"\tv1.0.0\n", "v1.0.0"},
		{"v1.2.3-4-gabcdef0-dirty", "v1.2.3"}, // git describe after the tag
		{"v1.2.3-4-gabcdef0", "v1.2.3"},
		{"v1.3.0-rc.1", "v1.3.0"},
		{"v1.2.3+build.5", "v1.2.3"},
		{"v1.2.3-rc.1+build.5", "v1.2.3"},
		{"v01.2.3", ""}, // a leading zero is not semver
		{"", ""},
		{"  ", ""},
		{"v", ""},
		{"devel", ""},
		{UnknownVersion, ""},
		{"(devel)", ""},
		{"v1.2.3.4", ""},
		{"abc123", ""},
		{"vv1.2.3", ""},
		{"V1.2.3", ""},
		{"v0.0.0", "v0.0.0"},
		{"v1.02.3", ""},
		{"v1.2-rc.1", ""}, // a shorthand takes no suffix
		{"v1-rc", ""},
		{"v1+build", ""},
		{"v1.2.3-", ""},
		{"v1.2.3+", ""},
		{"v1.2.3-a..b", ""},
		{"v1.2.3-01", ""}, // a numeric pre-release identifier has no leading zero
		{"v1.2.3-0a", "v1.2.3"},
		{"v1.2.3-0", "v1.2.3"},
		{"v1.2.3+01", "v1.2.3"}, // a build identifier may
		{"v1.2.3-rc_1", ""},
		{"v1.2.3+a+b", ""},
		{"v1.2.3-a-b.c+d-e.f", "v1.2.3"},
		{"v1.2.3 -4", ""},
	}
	for _, c := range cases {
		require.Equal(t, c.want, Release(c.in), "Release(%q)", c.in)
	}
}
