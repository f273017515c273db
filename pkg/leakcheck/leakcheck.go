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
	"testing"

	"go.uber.org/goleak"
)

// Options are the goroutines every test binary may leave running: none of
// them started by leasehold's code, each a long-lived helper of a library
// or of the standard library that lives as long as the process and cannot
// be stopped from outside.
func Options() []goleak.Option {
	return []goleak.Option{}
}

// Main runs the package's tests and, when they pass, fails the binary if a
// goroutine is still running after them (goleak.VerifyTestMain), besides
// those of Options and opts. A package passes opts only for a goroutine it
// cannot stop, with a comment saying whose it is and why.
func Main(m *testing.M, opts ...goleak.Option) {
	goleak.VerifyTestMain(m, append(Options(), opts...)...)
}
