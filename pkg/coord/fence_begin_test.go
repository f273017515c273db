package coord_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// pauseAfterBegin is a pgx tracer that stops the caller at the first
// statement after BEGIN, as SIGSTOP would between two round trips, until
// release is closed.
type pauseAfterBegin struct {
	paused  chan struct{}
	release chan struct{}
}

func (p *pauseAfterBegin) hold(sql string) {
	if strings.HasPrefix(strings.ToUpper(strings.TrimSpace(sql)), "BEGIN") {
		return
	}
	select {
	case <-p.paused:
	default:
		close(p.paused)
		<-p.release
	}
}

func (p *pauseAfterBegin) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	p.hold(d.SQL)
	return ctx
}
func (p *pauseAfterBegin) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (p *pauseAfterBegin) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	p.hold("batch")
	return ctx
}
func (p *pauseAfterBegin) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (p *pauseAfterBegin) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// TestHolderPausedAfterBeginIsEndedByTheServer: a holder stopped right after
// its BEGIN (before the fence, before any SET it might send next) still
// has its transaction ended by the server within the statement timeout,
// because the timeouts travel with BEGIN. Without that, the transaction
// would stay open until the process woke, and no session timeout ends it.
func TestHolderPausedAfterBeginIsEndedByTheServer(t *testing.T) {
	if pgtest.Pooled() {
		t.Skip("PgBouncer hides the backend this test watches in pg_stat_activity")
	}
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	createLog(t, db.Pool)
	a, err := coord.NewClient(db.Pool, "owner-a")
	require.NoError(t, err)
	l, ok, err := a.Acquire(ctx, "singleton:paused-after-begin", time.Minute)
	require.NoError(t, err)
	require.True(t, ok)

	cfg, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	const app = "paused-after-begin"
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	tr := &pauseAfterBegin{paused: make(chan struct{}), release: make(chan struct{})}
	cfg.ConnConfig.Tracer = tr
	paused, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer paused.Close()
	var once sync.Once
	release := func() { once.Do(func() { close(tr.release) }) }
	defer release() // before Close, which waits for the held connection

	done := make(chan error, 1)
	go func() {
		done <- coord.RunFenced(ctx, paused, l, coord.FenceOptions{StatementTimeout: 200 * time.Millisecond},
			func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "INSERT INTO fenced_log VALUES ('a', $1, 'after the pause')", l.Epoch)
				return err
			})
	}()
	<-tr.paused
	openTx := func() int {
		var n int
		require.NoError(t, db.Pool.QueryRow(ctx,
			`SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND xact_start IS NOT NULL`, app).Scan(&n))
		return n
	}
	require.Eventually(t, func() bool { return openTx() == 1 }, 10*time.Second, 10*time.Millisecond,
		"the paused holder's transaction is open")
	require.Eventually(t, func() bool { return openTx() == 0 }, 30*time.Second, 20*time.Millisecond,
		"the server ends the paused holder's transaction by its idle timeout")
	release()
	require.Error(t, <-done, "the woken holder's transaction is gone")
	require.Zero(t, countLog(t, db.Pool, "a"))
}
