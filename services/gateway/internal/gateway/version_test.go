package gateway

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jonboulle/clockwork"
	"github.com/stretchr/testify/require"
	"golang.org/x/mod/semver"

	"github.com/leasehold/leasehold/pkg/buildinfo"
	"github.com/leasehold/leasehold/pkg/daemon"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestVersionRefusal: the minimum daemon version check; the version parser
// itself is buildinfo.Release (TestRelease in pkg/buildinfo).
func TestVersionRefusal(t *testing.T) {
	t.Parallel()
	require.Empty(t, versionRefusal("", ""), "no minimum accepts everything")
	require.Empty(t, versionRefusal("devel", ""))
	require.Empty(t, versionRefusal("v1.4.0", "v1.4.0"))
	require.Empty(t, versionRefusal("v1.4.0-3-gabc", "v1.4.0"), "a build after the tag is that release")
	require.Empty(t, versionRefusal("v1.10.0", "v1.4.0"), "numeric, not lexical")
	require.Contains(t, versionRefusal("v1.3.9", "v1.4.0"), `hello.daemon_version "v1.3.9" is older than the minimum v1.4.0`)
	require.Contains(t, versionRefusal("", "v1.4.0"), `hello.daemon_version "" is not a semantic version`)
	require.Contains(t, versionRefusal("devel", "v1.4.0"), "v1.4.0")

	c := testConfig()
	c.MinDaemonVersion = "latest"
	require.ErrorContains(t, c.Validate(), "--gateway.min-daemon-version")
	c.MinDaemonVersion = "1.4"
	require.NoError(t, c.Validate())
	for range 100 {
		d := versionRetryAfter()
		require.True(t, d >= 5*time.Minute && d < 10*time.Minute, "retry after %s", d)
	}
}

// releaseByXMod is the release parser the gateway had before
// buildinfo.Release, on golang.org/x/mod/semver (which buildinfo does not
// import): the reference FuzzReleaseAgreesWithXModSemver holds Release to.
func releaseByXMod(version string) string {
	v := strings.TrimSpace(version)
	if v == "" {
		return ""
	}
	if !strings.HasPrefix(v, "v") {
		v = "v" + v
	}
	c := semver.Canonical(v)
	if pre := semver.Prerelease(c); pre != "" {
		c = strings.TrimSuffix(c, pre)
	}
	return c
}

// FuzzReleaseAgreesWithXModSemver: buildinfo.Release accepts and reads a
// version exactly as golang.org/x/mod/semver does, so the minimum daemon
// version compares as it did before the parser moved.
func FuzzReleaseAgreesWithXModSemver(f *testing.F) {
	for _, s := range []string{"v1.2.3", "1.2.3", "v1.2", "2", " v1.0.0 ", "v1.2.3-4-gabcdef0-dirty", "v1.3.0-rc.1",
		"v1.2.3+build.5", "v1.2.3-rc.1+build.5", "v01.2.3", "", "v", "devel", "v1.2.3.4", "vv1.2.3", "V1.2.3",
		"v1.2-rc.1", "v1-rc", "v1+b", "v1.2.3-", "v1.2.3+", "v1.2.3-a..b", "v1.2.3-01", "v1.2.3-0a", "v1.2.3+01",
		"v1.2.3-rc_1", "v1.2.3+a+b", "v1.2.3-a-b.c+d-e.f", "v0.0.0", "v1.02.3", "v99999999999999999999.0.0"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		if got, want := buildinfo.Release(v), releaseByXMod(v); got != want {
			t.Fatalf("buildinfo.Release(%q) = %q, golang.org/x/mod/semver reads %q", v, got, want)
		}
	})
}

// TestOldDaemonIsRefusedWithALongRetryAfter: a Hello older than the
// gateway's minimum gets a Pushback of 5-10 min and FAILED_PRECONDITION
// naming the field and the minimum, before the credential or the database;
// a current daemon is welcomed.
func TestOldDaemonIsRefusedWithALongRetryAfter(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	creds := registerNodes(t, db, "v", 2)
	cfg := testConfig()
	cfg.MinDaemonVersion = "v1.4.0"
	g := startGateway(t, db, cfg)
	before := fingerprint(t, db)

	for _, version := range []string{"v1.3.9", "", "devel"} {
		s := dialRaw(t, g.Addr())
		require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Hello{Hello: &nodev1.Hello{
			NodeId: "v-0", Credential: creds[0], Kind: nodev1.NodeKind_NODE_KIND_NODE, DaemonVersion: version,
		}}}))
		m, err := s.recv(t, 10*time.Second)
		require.NoError(t, err)
		pb := m.GetPushback()
		require.NotNil(t, pb, "version %q: want Pushback, got %v", version, m)
		require.Equal(t, "daemon-version", pb.GetReason())
		ra := pb.GetRetryAfter().AsDuration()
		require.True(t, ra >= 5*time.Minute && ra < 10*time.Minute, "retry after %s", ra)
		_, err = s.recv(t, 10*time.Second)
		require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err), "version %q: %v", version, err)
		require.ErrorContains(t, err, "hello.daemon_version")
		require.ErrorContains(t, err, "v1.4.0")
	}
	require.Equal(t, before, fingerprint(t, db), "a refused Hello writes nothing")

	s := dialRaw(t, g.Addr())
	require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Hello{Hello: &nodev1.Hello{
		NodeId: "v-1", Credential: creds[1], Kind: nodev1.NodeKind_NODE_KIND_NODE, DaemonVersion: "v1.4.0-2-gabcdef0",
	}}}))
	m, err := s.recv(t, 10*time.Second)
	require.NoError(t, err)
	require.NotNil(t, m.GetWelcome(), "a current daemon is welcomed, got %v", m)
}

// TestDaemonWaitsOutAVersionRefusal: pkg/daemon, refused for its version by
// a real gateway, does not redial before the retry-after (at least 5 min on
// its clock).
func TestDaemonWaitsOutAVersionRefusal(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	creds := registerNodes(t, db, "w", 1)
	cfg := testConfig()
	cfg.MinDaemonVersion = "v2.0.0"
	g := startGateway(t, db, cfg)
	clock := clockwork.NewFakeClock()
	d, err := daemon.New(daemon.Config{Address: "http://" + g.Addr(), NodeID: "w-0", Credential: creds[0], Version: "v1.9.9",
		Handler: noopHandler, Clock: clock, BackoffBase: time.Millisecond, BackoffMax: time.Millisecond})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = d.Run(ctx) })
	defer func() { cancel(); wg.Wait() }()

	require.Eventually(t, func() bool { return d.Stats().Pushbacks == 1 }, 10*time.Second, 5*time.Millisecond)
	require.NoError(t, clock.BlockUntilContext(ctx, 1)) // waiting out retry_after
	clock.Advance(5*time.Minute - time.Second)
	require.NoError(t, clock.BlockUntilContext(ctx, 1)) // still waiting, not dialling
	require.EqualValues(t, 1, d.Stats().Dials, "no redial before the retry-after")
	clock.Advance(5 * time.Minute)
	require.Eventually(t, func() bool { return d.Stats().Dials == 2 }, 10*time.Second, 5*time.Millisecond)
}
