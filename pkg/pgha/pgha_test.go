package pgha_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgha"
	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func skipWithoutBinaries(t *testing.T) {
	t.Helper()
	if _, err := pglocal.BinDir(); err != nil {
		t.Skip(err)
	}
	if pgtest.Pooled() {
		t.Skip("starts its own servers on direct URLs: runs once, in the default mode")
	}
}

func ctxFor(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func connect(t *testing.T, ctx context.Context, url string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

func count(t *testing.T, ctx context.Context, url, sql string, args ...any) int {
	t.Helper()
	conn := connect(t, ctx, url)
	var n int
	require.NoError(t, conn.QueryRow(ctx, sql, args...).Scan(&n))
	return n
}

// TestSyncCommitWaitsForTheStandby: with the standby's WAL receiver stopped a
// commit on the primary does not return: it waits in SyncRep, and the row is
// not on the standby. Once replication resumes the commit returns, and after
// the primary is killed and the standby promoted the row is there.
func TestSyncCommitWaitsForTheStandby(t *testing.T) {
	skipWithoutBinaries(t)
	ctx := ctxFor(t)
	p := pgha.Start(t, pgha.Options{Sync: true})
	primary := connect(t, ctx, p.PrimaryURL())
	_, err := primary.Exec(ctx, "CREATE TABLE acked (id int PRIMARY KEY)")
	require.NoError(t, err)
	require.NoError(t, p.WaitReplicated(ctx))

	require.NoError(t, p.PauseReplication(ctx))
	writer := connect(t, ctx, p.PrimaryURL())
	var pid int
	require.NoError(t, writer.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid))
	done := make(chan error, 1)
	go func() {
		_, err := writer.Exec(ctx, "INSERT INTO acked VALUES (1)")
		done <- err
	}()
	require.Eventually(t, func() bool {
		var ev string
		err := primary.QueryRow(ctx, "SELECT coalesce(wait_event, '') FROM pg_stat_activity WHERE pid = $1", pid).Scan(&ev)
		return err == nil && ev == "SyncRep"
	}, time.Minute, 20*time.Millisecond, "the commit waits for the synchronous standby")
	select {
	case err := <-done:
		t.Fatalf("the commit returned (%v) while the standby received nothing", err)
	default:
	}
	require.Zero(t, count(t, ctx, p.StandbyURL(), "SELECT count(*) FROM acked"), "the standby has not received the row")

	require.NoError(t, p.ResumeReplication(ctx))
	require.NoError(t, <-done, "the commit returns once the standby has it")
	require.NoError(t, p.KillPrimary(ctx))
	require.NoError(t, p.Promote(ctx))
	require.Equal(t, 1, count(t, ctx, p.StandbyURL(), "SELECT count(*) FROM acked WHERE id = 1"))
}

// TestSyncPromotionUnderLoadLosesNothingAcknowledged: writers insert rows
// through a pool on the multi-host URL while the primary is killed. After
// the standby is promoted the same pool writes again, now on the standby's
// port, on timeline 2, and every insert that returned success is there.
func TestSyncPromotionUnderLoadLosesNothingAcknowledged(t *testing.T) {
	skipWithoutBinaries(t)
	ctx := ctxFor(t)
	p := pgha.Start(t, pgha.Options{Sync: true})
	pool, err := pgdb.Connect(ctx, pgdb.Config{URL: p.MultiHostURL(), AppName: "pgha-test", MaxConns: 8, ConnectTimeout: 2 * time.Second})
	require.NoError(t, err)
	defer pool.Close()
	_, err = pool.Exec(ctx, "CREATE TABLE acked (id bigint PRIMARY KEY)")
	require.NoError(t, err)
	require.Equal(t, p.Primary().Port(), serverPort(t, ctx, pool))
	tli, err := p.Timeline(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, tli)

	var (
		mu    sync.Mutex
		acked []int64
		next  int64
		stop  = make(chan struct{})
		wg    sync.WaitGroup
	)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				mu.Lock()
				next++
				id := next
				mu.Unlock()
				if _, err := pool.Exec(ctx, "INSERT INTO acked VALUES ($1)", id); err == nil {
					mu.Lock()
					acked = append(acked, id)
					mu.Unlock()
				} else {
					time.Sleep(20 * time.Millisecond) // back off while no server takes writes
				}
			}
		}()
	}
	ackedNow := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(acked)
	}
	require.Eventually(t, func() bool { return ackedNow() >= 200 }, time.Minute, 10*time.Millisecond)
	require.NoError(t, p.KillPrimary(ctx))
	before := ackedNow()
	require.NoError(t, p.Promote(ctx))
	require.Eventually(t, func() bool { return ackedNow() >= before+100 }, time.Minute, 10*time.Millisecond,
		"the pool on the multi-host URL writes again after the promotion")
	close(stop)
	wg.Wait()

	require.Equal(t, p.Standby().Port(), serverPort(t, ctx, pool))
	tli, err = p.Timeline(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, tli)
	conn := connect(t, ctx, p.StandbyURL())
	var missing int
	require.NoError(t, conn.QueryRow(ctx, "SELECT count(*) FROM unnest($1::bigint[]) AS a(id) WHERE NOT EXISTS (SELECT 1 FROM acked WHERE acked.id = a.id)",
		acked).Scan(&missing))
	require.Zero(t, missing, "every acknowledged insert of %d survived the failover", len(acked))
}

func serverPort(t *testing.T, ctx context.Context, pool *pgxpool.Pool) int {
	t.Helper()
	var port string
	require.NoError(t, pool.QueryRow(ctx, "SELECT current_setting('port')").Scan(&port))
	n, err := strconv.Atoi(port)
	require.NoError(t, err)
	return n
}

// TestAsyncPromotionLosesWhatTheStandbyNeverReceived is the point of the
// asynchronous case: a commit the primary acknowledged while the standby's
// WAL receiver was down is gone after a promotion. A restart of the primary
// (outage, no promotion) loses nothing and replication resumes. Close then
// leaves no server and no directory behind.
func TestAsyncPromotionLosesWhatTheStandbyNeverReceived(t *testing.T) {
	skipWithoutBinaries(t)
	ctx := ctxFor(t)
	p := pgha.Start(t, pgha.Options{})
	primary := connect(t, ctx, p.PrimaryURL())
	_, err := primary.Exec(ctx, "CREATE TABLE acked (id int PRIMARY KEY); INSERT INTO acked VALUES (1)")
	require.NoError(t, err)
	primary.Close(ctx)

	require.NoError(t, p.StopPrimary(ctx, true))
	require.NoError(t, p.StartPrimary(ctx))
	primary = connect(t, ctx, p.PrimaryURL())
	_, err = primary.Exec(ctx, "INSERT INTO acked VALUES (2)")
	require.NoError(t, err)
	require.NoError(t, p.WaitReplicated(ctx))
	require.Equal(t, 2, count(t, ctx, p.StandbyURL(), "SELECT count(*) FROM acked"))

	require.NoError(t, p.PauseReplication(ctx))
	_, err = primary.Exec(ctx, "INSERT INTO acked VALUES (3)")
	require.NoError(t, err, "an asynchronous commit returns without the standby")
	require.NoError(t, p.KillPrimary(ctx))
	require.NoError(t, p.Promote(ctx))
	require.Error(t, p.StartPrimary(ctx), "the old primary must not come back as a second primary")

	var ids []int
	rows, err := connect(t, ctx, p.StandbyURL()).Query(ctx, "SELECT id FROM acked ORDER BY id")
	require.NoError(t, err)
	ids, err = pgx.CollectRows(rows, pgx.RowTo[int])
	require.NoError(t, err)
	require.Equal(t, []int{1, 2}, ids, "row 3 was acknowledged by the old primary and is lost")
	tli, err := p.Timeline(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, tli)

	// Close stops the surviving server too and removes every directory.
	standbyPID, err := p.Standby().PostmasterPID()
	require.NoError(t, err)
	dir := filepath.Dir(filepath.Dir(p.Primary().DataDir()))
	require.NoError(t, p.Close())
	require.NoError(t, p.Close(), "Close is idempotent")
	_, err = os.Stat(dir)
	require.True(t, errors.Is(err, os.ErrNotExist), "pair directory removed: %v", err)
	require.False(t, alive(standbyPID), "standby postmaster %d gone", standbyPID)
}

// alive reports whether pid exists and is not a zombie.

func alive(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(b, ')')
	return i < 0 || i+2 >= len(b) || (b[i+2] != 'Z' && b[i+2] != 'X')
}
