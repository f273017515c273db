// Package leakcheck fails a test binary whose tests leave goroutines behind.
// Every test package of the repository calls it from its TestMain:
//
//	func TestMain(m *testing.M) { leakcheck.Main(m) }
//
// A package that starts PostgreSQL through pkg/pgtest calls pgtest.Main
// instead: it stops the server the binary started and then runs the same
// check (goleak.Find) before the binary exits.
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

// Main runs the package's tests, removes the binaries they built
// (proctest.RemoveBuilt) and, when they passed, fails the binary if a
// goroutine is still running after them (goleak.Find), besides those of
// Options and opts. A package passes opts only for a goroutine it cannot
// stop, with a comment saying whose it is and why.
func Main(m *testing.M, opts ...goleak.Option) {
	code := m.Run()
	proctest.RemoveBuilt()
	if code == 0 {
		if err := goleak.Find(append(Options(), opts...)...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: Errors on successful test run: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}
