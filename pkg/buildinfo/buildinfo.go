// Package buildinfo says which build of leasehold is running: the version
// stamped at link time (the Makefile and the Dockerfile pass `git describe`
// with -ldflags -X), the VCS revision, and the Go version. Every binary's
// --version, the leasehold_build_info gauge, /healthz/detail and the
// daemon's Hello read it from here.
//
// Without -ldflags (a plain `go build` or `go test`) the version falls back
// to the main module's version and the revision to the vcs.revision that
// the go command stamps when it builds from a git checkout
// (runtime/debug.ReadBuildInfo); when neither is known they read "devel"
// and "unknown".
package buildinfo

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"sync"
)

// Set with -ldflags "-X github.com/leasehold/leasehold/pkg/buildinfo.version=v1.2.3
// -X github.com/leasehold/leasehold/pkg/buildinfo.revision=<commit>".
var (
	version  string
	revision string
)

// Fallback values when nothing is stamped.
const (
	UnknownVersion  = "devel"
	UnknownRevision = "unknown"
)

// Info describes the running build. Every field is non-empty.
type Info struct {
	// Version is the release (`git describe --tags --always --dirty`).
	Version string `json:"version"`
	// Revision is the full commit id, with "-dirty" when the tree had
	// uncommitted changes (as the go command recorded it).
	Revision string `json:"revision"`
	// GoVersion is the Go toolchain that built the binary.
	GoVersion string `json:"goversion"`
}

var (
	once sync.Once
	info Info
)

// Get returns the running build's Info; it is computed once and never
// changes.
func Get() Info {
	once.Do(func() { info = resolve(version, revision, readBuildInfo()) })
	return info
}

// Version is Get().Version.
func Version() string { return Get().Version }

// String renders the build for --version: "<name> <version> (revision
// <revision>, <goversion>)".
func String(name string) string {
	i := Get()
	return fmt.Sprintf("%s %s (revision %s, %s)", name, i.Version, i.Revision, i.GoVersion)
}

func readBuildInfo() *debug.BuildInfo {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return nil
	}
	return bi
}

// resolve applies the fallbacks: stamped values first, then the build
// information of the go command, then the Unknown constants.
func resolve(stampedVersion, stampedRevision string, bi *debug.BuildInfo) Info {
	i := Info{Version: stampedVersion, Revision: stampedRevision, GoVersion: runtime.Version()}
	if bi != nil {
		if i.Version == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			i.Version = bi.Main.Version
		}
		if bi.GoVersion != "" {
			i.GoVersion = bi.GoVersion
		}
		if i.Revision == "" {
			var rev string
			var modified bool
			for _, s := range bi.Settings {
				switch s.Key {
				case "vcs.revision":
					rev = s.Value
				case "vcs.modified":
					modified = s.Value == "true"
				}
			}
			if rev != "" && modified {
				rev += "-dirty"
			}
			i.Revision = rev
		}
	}
	if i.Version == "" {
		i.Version = UnknownVersion
	}
	if i.Revision == "" {
		i.Revision = UnknownRevision
	}
	return i
}
