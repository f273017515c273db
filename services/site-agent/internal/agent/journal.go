package agent

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/leasehold/leasehold/pkg/daemon"
)

// openJournal opens the journal at path (--journal): its directory is
// created 0700 when missing and refused when group or others may write to
// it (they could remove a command's record, and the command would run
// again). The journal's own lock (<path>.lock) refuses a second agent given
// the same file. Every error names the flag.
func openJournal(path string) (*daemon.FileJournal, error) {
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
	fj, err := daemon.OpenFileJournal(path)
	if errors.Is(err, daemon.ErrJournalLocked) {
		return nil, fmt.Errorf("--journal %s: another process holds %s.lock (each site agent needs a journal of its own)", path, path)
	}
	if err != nil {
		return nil, fmt.Errorf("--journal %s: %w", path, err)
	}
	return fj, nil
}
