package process_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/process"
)

// TestGenericPlansKeepStatisticsFresh: a process whose pool plans
// generically analyzes a table that outgrew its statistics by itself; the
// signal is PostgreSQL's own count of analyzes of the table and the log
// line naming it. Autovacuum is off for the table, so only the process
// can have analyzed it.
func TestGenericPlansKeepStatisticsFresh(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `CREATE TABLE grown (id int PRIMARY KEY) WITH (autovacuum_enabled = false);
		INSERT INTO grown SELECT generate_series(1, 5000)`)
	require.NoError(t, err)
	logs, err := os.CreateTemp(t.TempDir(), "log")
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	spec := process.Spec{
		Name: "testsvc", HTTPAddr: "127.0.0.1:0", GenericPlans: true,
		Build: func(context.Context, *process.Process) ([]services.Service, error) {
			return []services.Service{services.NewIdleService(nil, nil)}, nil
		},
	}
	exit := make(chan int, 1)
	go func() {
		exit <- process.Run(ctx, spec, []string{"--database-url", db.URL, "--http-addr", "127.0.0.1:0"}, logs)
	}()
	require.Eventually(t, func() bool {
		var n int64
		err := db.Pool.QueryRow(ctx, `SELECT analyze_count FROM pg_stat_user_tables WHERE relname = 'grown'`).Scan(&n)
		return err == nil && n > 0
	}, 60*time.Second, 50*time.Millisecond, "the process never analyzed the grown table")
	cancel()
	require.Equal(t, 0, <-exit)
	out, err := os.ReadFile(logs.Name())
	require.NoError(t, err)
	require.Contains(t, string(out), `"table":"grown"`)
}
