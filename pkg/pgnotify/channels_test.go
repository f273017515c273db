package pgnotify_test

import (
	"io/fs"
	"regexp"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/migrations"
	"github.com/leasehold/leasehold/pkg/pgnotify"
)

// TestChannelsMatchMigrations: every channel a migration notifies on is a
// constant of pgnotify, and every constant but LeaseReleased (whose
// statements pkg/coord builds from the constant itself) is notified by a
// migration under exactly that name.
func TestChannelsMatchMigrations(t *testing.T) {
	t.Parallel()
	notifyCall := regexp.MustCompile(`pg_notify\(\s*'([^']*)'`)
	inMigrations := map[string]bool{}
	err := fs.WalkDir(migrations.FS(), ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := fs.ReadFile(migrations.FS(), path)
		if err != nil {
			return err
		}
		for _, m := range notifyCall.FindAllSubmatch(b, -1) {
			inMigrations[string(m[1])] = true
		}
		return nil
	})
	require.NoError(t, err)
	require.NotEmpty(t, inMigrations, "the migrations notify on some channel")
	for ch := range inMigrations {
		require.Contains(t, pgnotify.Channels, ch, "migration channel %q has no pgnotify constant", ch)
	}
	for _, ch := range pgnotify.Channels {
		if ch == pgnotify.LeaseReleased || ch == pgnotify.CommandDone || ch == pgnotify.CommandOutput {
			continue // notified by Go code that builds its SQL from the constant
		}
		require.True(t, inMigrations[ch], "no migration notifies on %q", ch)
	}
}
