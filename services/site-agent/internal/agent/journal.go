package agent

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"

	"github.com/leasehold/leasehold/pkg/daemon"
)

// journal is the agent's durable command journal (pkg/daemon's
// FileJournal, the node agent's) and the lock that keeps it to one process.
type journal struct {
	*daemon.FileJournal
	lock *os.File
}

// openJournal opens the journal at path (--journal): its directory is
// created 0700 when missing and refused when group or others may write to
// it (they could remove a command's record, and the command would run
// again); <path>.lock is locked so a second agent given the same file is
// refused instead of interleaving its records with this one's. The lock
// goes with the process, so a killed agent leaves none behind. Every error
// names the flag.
func openJournal(path string) (*journal, error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("--journal %s: create its directory: %w", path, err)
	}
	st, err := os.Stat(dir)
	if err != nil {
		return nil, fmt.Errorf("--journal %s: %w", path, err)
	}
	if !st.IsDir() {
		return nil, fmt.Errorf("--journal %s: %s is not a directory", path, dir)
	}
	if st.Mode().Perm()&0o022 != 0 {
		return nil, fmt.Errorf("--journal %s: its directory %s has mode %04o: group or others may write to it (chmod 700 %s)",
			path, dir, st.Mode().Perm(), dir)
	}
	lock, err := os.OpenFile(path+".lock", os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("--journal %s: %w", path, err)
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		_ = lock.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("--journal %s: another process holds %s.lock (each site agent needs a journal of its own)", path, path)
		}
		return nil, fmt.Errorf("--journal %s: lock %s.lock: %w", path, path, err)
	}
	fj, err := daemon.OpenFileJournal(path)
	if err != nil {
		_ = lock.Close()
		return nil, fmt.Errorf("--journal %s: %w", path, err)
	}
	return &journal{FileJournal: fj, lock: lock}, nil
}

// Close closes the journal, then releases the lock.
func (j *journal) Close() error {
	err := j.FileJournal.Close()
	return errors.Join(err, j.lock.Close())
}
