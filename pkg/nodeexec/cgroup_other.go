//go:build !linux

package nodeexec

import (
	"errors"
	"log/slog"
	"syscall"
	"time"
)

// errNoCgroups: cgroups are Linux's; elsewhere commands run in their
// process groups only.
var errNoCgroups = errors.New("cgroups exist on Linux only")

type cgroupRoot struct{ dir string }

type cmdCgroup struct{ dir string }

func setupCgroups(cgroupPaths, *slog.Logger) (*cgroupRoot, error) { return nil, errNoCgroups }

func probeCgroups(cgroupPaths) (string, []int, error) { return "", nil, errNoCgroups }

func (r *cgroupRoot) create(string) (*cmdCgroup, error) { return nil, errNoCgroups }

func (c *cmdCgroup) setProcAttr(*syscall.SysProcAttr) {}

func (c *cmdCgroup) closeFD() {}

func (c *cmdCgroup) kill() error { return errNoCgroups }

func (c *cmdCgroup) populated() (bool, error) { return false, errNoCgroups }

func (c *cmdCgroup) signalOutsideGroup(int, syscall.Signal) {}

func (c *cmdCgroup) remove(time.Duration) error { return nil }
