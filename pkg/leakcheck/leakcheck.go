// Package leakcheck fails a test binary whose tests leave goroutines behind.
// Every test package of the repository calls it from its TestMain:
//
//	func TestMain(m *testing.M) { leakcheck.Main(m) }
//
// A package that starts PostgreSQL through pkg/pgtest calls pgtest.Main
// instead: it stops the server the binary started and then ends the binary
// with this package's Exit, as Main does.
//
// Only tests import this package, so goleak is never linked into a service
// binary.
package leakcheck

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/leasehold/leasehold/pkg/proctest"
)

// Options are the goroutines every test binary may leave running: none of
// them started by leasehold's code, each a long-lived helper of a library
// or of the standard library that lives as long as the process and cannot
// be stopped from outside.
func Options() []goleak.Option {
	return []goleak.Option{}
}

// Main runs the package's tests and ends the binary with Exit: the
// binaries they built are removed and, when they passed, the binary fails
// if a goroutine is still running after them, besides those of Options and
// opts. A package passes opts only for a goroutine it cannot stop, with a
// comment saying whose it is and why.
func Main(m *testing.M, opts ...goleak.Option) {
	Exit(m.Run(), opts...)
}

// Exit ends a test binary whose tests returned code: it removes the
// binaries they built (proctest.RemoveBuilt), then, when code is 0, fails
// the binary if a goroutine is still running besides those of Options and
// opts (goleak.Find), and exits. Main and pgtest.Main end with it.
func Exit(code int, opts ...goleak.Option) {
	proctest.RemoveBuilt()
	if code == 0 {
		if err := goleak.Find(append(Options(), opts...)...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: Errors on successful test run: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}
