//go:build !linux

package daemon

import (
	"errors"
	"os/user"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// shellSpec is what a shell tunnel runs.
type shellSpec struct {
	argv []string
	size *nodev1.TerminalSize
	term string
	user *user.User
}

// shellProc is a running tunnel shell; shells run on Linux only.
type shellProc struct {
	tunnelTarget
	exited chan struct{}
}

func (s *shellProc) exitStatus() *nodev1.ShellExit     { return nil }
func (s *shellProc) resize(*nodev1.TerminalSize) error { return nil }
func lookupShellUser(name string) (*user.User, error)  { return user.Lookup(name) }
func startShell(shellSpec) (*shellProc, error)         { return nil, errShellLinuxOnly }

var errShellLinuxOnly = errors.New("shell tunnels run on Linux only")
