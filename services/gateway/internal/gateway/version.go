package gateway

import (
	"fmt"
	"math/rand/v2"
	"time"

	"golang.org/x/mod/semver"

	"github.com/leasehold/leasehold/pkg/buildinfo"
)

// Version skew (docs/gateway.md, "Daemon versions"): a gateway with
// --gateway.min-daemon-version refuses a Hello from an older daemon with
// FAILED_PRECONDITION and a Pushback whose retry_after is long enough that
// a fleet of old daemons does not come back at once.

// Retry-after of a refused daemon version: versionRetryBase plus up to
// versionRetryJitter. An old daemon stays refused until it is upgraded, so
// it should dial rarely; the jitter spreads a fleet's redials.
const (
	versionRetryBase   = 5 * time.Minute
	versionRetryJitter = 5 * time.Minute
)

// versionRefusal returns why the daemon version of a Hello is refused, or
// "" when min is "" (no minimum) or version is at least min, min being a
// release of buildinfo.Release and version compared by its release. A version
// that is missing or not semantic is refused: the gateway cannot tell that
// it speaks what the minimum requires.
func versionRefusal(version, min string) string {
	if min == "" {
		return ""
	}
	got := buildinfo.Release(version)
	switch {
	case got == "":
		return fmt.Sprintf("hello.daemon_version %q is not a semantic version; this gateway requires at least %s (--gateway.min-daemon-version)", version, min)
	case semver.Compare(got, min) < 0:
		return fmt.Sprintf("hello.daemon_version %q is older than the minimum %s this gateway accepts (--gateway.min-daemon-version); upgrade the daemon", version, min)
	}
	return ""
}

// versionRetryAfter is the retry_after sent with a version refusal.
func versionRetryAfter() time.Duration {
	return versionRetryBase + rand.N(versionRetryJitter)
}
