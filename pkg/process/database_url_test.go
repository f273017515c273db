package process_test

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/grafana/dskit/services"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgha"
	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/pkg/process"
)

// runLogged runs a do-nothing service with args and returns its exit code
// and what it logged; built reports whether Build was reached.
func runLogged(t *testing.T, args ...string) (code int, out string, built bool) {
	t.Helper()
	logs, err := os.CreateTemp(t.TempDir(), "log")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	spec := process.Spec{Name: "testsvc", HTTPAddr: "127.0.0.1:0",
		Build: func(context.Context, *process.Process) ([]services.Service, error) {
			built = true
			cancel() // a process that got this far stops at once
			return nil, nil
		}}
	code = process.Run(ctx, spec, args, logs)
	b, err := os.ReadFile(logs.Name())
	require.NoError(t, err)
	return code, string(b), built
}

// TestRunRefusesMultiHostURLWithoutTargetSessionAttrs: a --database-url or
// --listen-database-url listing several hosts without
// target_session_attrs=read-write is a configuration error (exit 2) that
// names the flag and the fix, before anything is dialled.
func TestRunRefusesMultiHostURLWithoutTargetSessionAttrs(t *testing.T) {
	t.Parallel()
	code, out, built := runLogged(t,
		"--database-url", "postgres://u:p@127.0.0.1:1,127.0.0.1:2/lh",
		"--listen-database-url", "host=127.0.0.1,127.0.0.1 port=1,2 user=u dbname=lh target_session_attrs=prefer-standby")
	require.Equal(t, 2, code, out)
	require.False(t, built)
	require.Contains(t, out, "--database-url lists several hosts without target_session_attrs=read-write (or primary) (127.0.0.1:1, 127.0.0.1:2)")
	require.Contains(t, out, "--listen-database-url lists several hosts without target_session_attrs=read-write")
	require.Contains(t, out, "?target_session_attrs=read-write")
}

// TestRunRefusesAStandby: a --database-url that reaches a server in recovery
// is refused at start (exit 1) with a message naming the flag; the same
// servers listed with target_session_attrs=read-write, standby first, start.
func TestRunRefusesAStandby(t *testing.T) {
	if _, err := pglocal.BinDir(); err != nil {
		t.Skip(err)
	}
	p := pgha.Start(t, pgha.Options{})
	code, out, built := runLogged(t, "--database-url", p.StandbyURL())
	require.Equal(t, 1, code, out)
	require.False(t, built)
	require.Contains(t, out, "--database-url points at a standby (pg_is_in_recovery() is true)")

	standbyFirst := fmt.Sprintf("postgres://postgres:postgres@127.0.0.1:%d,127.0.0.1:%d/%s?sslmode=disable&target_session_attrs=read-write",
		p.Standby().Port(), p.Primary().Port(), pgha.DBName)
	code, out, built = runLogged(t, "--database-url", standbyFirst)
	require.Equal(t, 0, code, out)
	require.True(t, built)
}
