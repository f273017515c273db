package fleet

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/leasehold/leasehold/bench/internal/harness"
)

// BuildNodesim builds cmd/nodesim into dir and returns the binary's path.
func BuildNodesim(dir string) (string, error) {
	bin := filepath.Join(dir, "nodesim")
	if err := harness.GoBuild(filepath.Join(harness.RepoRoot(), "bench", "cmd", "nodesim"), bin); err != nil {
		return "", err
	}
	return bin, nil
}

// NodeProcess is a nodesim process (cmd/nodesim) running simulated nodes
// in a process of its own, so that they do not share the bench's Go
// scheduler.
type NodeProcess struct {
	Proc      *harness.Proc
	nodesFile string
	connected atomic.Int64
}

// StartNodeProcess runs bin (from BuildNodesim) under sup as name, with the
// nodes ids[i] holding credential creds[i], dialling address and starting
// at most rate nodes per second. Its node list is written into dir.
func StartNodeProcess(sup *harness.Supervisor, bin, name, dir, address string, ids, creds []string, rate int) (*NodeProcess, error) {
	var lines strings.Builder
	for i := range ids {
		fmt.Fprintf(&lines, "%s %s\n", ids[i], creds[i])
	}
	np := &NodeProcess{nodesFile: filepath.Join(dir, name+".nodes")}
	if err := os.WriteFile(np.nodesFile, []byte(lines.String()), 0o600); err != nil {
		return nil, err
	}
	p, err := sup.StartLines(name, bin, nil, func(l string) {
		if v, ok := strings.CutPrefix(l, "CONNECTED "); ok {
			if k, err := strconv.Atoi(v); err == nil {
				np.connected.Store(int64(k))
			}
		}
	}, "-address", address, "-nodes", np.nodesFile, "-hello-rate", fmt.Sprint(rate))
	if err != nil {
		os.Remove(np.nodesFile)
		return nil, err
	}
	np.Proc = p
	return np, nil
}

// Connected is the number of its nodes with an open session, as the
// process last reported it.
func (np *NodeProcess) Connected() int { return int(np.connected.Load()) }

// Stop sends SIGTERM, waits up to 30 s for the exit and removes the node list.
func (np *NodeProcess) Stop() {
	_ = np.Proc.Signal(syscall.SIGTERM)
	np.Proc.Wait(30 * time.Second)
	os.Remove(np.nodesFile)
}
