package daemon

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/jonboulle/clockwork"
	"github.com/stretchr/testify/require"
)

// TestFileJournalRefusesASecondOpener: while one FileJournal holds a file,
// a second open of it (another agent given the same state directory) is
// ErrJournalLocked, and it writes nothing; once the first is closed, the
// file opens again with what the first recorded.
func TestFileJournalRefusesASecondOpener(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "journal")
	j, err := OpenFileJournal(path)
	require.NoError(t, err)
	require.NoError(t, j.Record("c1", nil))

	_, err = OpenFileJournal(path)
	require.ErrorIs(t, err, ErrJournalLocked)
	require.ErrorContains(t, err, path+".lock")

	require.NoError(t, j.Close())
	again, err := OpenFileJournal(path)
	require.NoError(t, err)
	t.Cleanup(func() { _ = again.Close() })
	require.Equal(t, []string{"c1"}, again.InFlight())
}

// TestFileJournalWaitsForALockAboutToBeReleased: a lock its holder lets go
// of within lockWait (a previous agent still exiting, or a forked child
// that shares the lock's file until it execs) is taken once released,
// instead of refusing the open.
func TestFileJournalWaitsForALockAboutToBeReleased(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "journal")
	j, err := OpenFileJournal(path)
	require.NoError(t, err)
	go func() {
		// The holder lets go a moment after the second open began to wait
		// (well inside lockWait).
		clockwork.NewRealClock().Sleep(50 * time.Millisecond)
		_ = j.Close()
	}()
	again, err := OpenFileJournal(path)
	require.NoError(t, err, "the open waits for the lock instead of refusing it")
	require.NoError(t, again.Close())
}
