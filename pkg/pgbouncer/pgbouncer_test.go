package pgbouncer_test

import (
	"context"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgbouncer"
	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgha"
	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestTransactionPoolingInFrontOfTheTestServer starts a PgBouncer of its own
// in front of the binary's test server and runs pooled transactions through
// it: queries reach the server (a different port), prepared statements are
// not needed (exec mode from the URL), and it stops cleanly.
func TestTransactionPoolingInFrontOfTheTestServer(t *testing.T) {
	if _, err := pgbouncer.Binary(); err != nil {
		t.Skip(err)
	}
	db := pgtest.NewDB(t)
	u, err := url.Parse(pgtest.Server(t).AdminURL())
	require.NoError(t, err)
	port, err := strconv.Atoi(u.Port())
	require.NoError(t, err)
	pw, _ := u.User.Password()
	ctx := context.Background()
	b, err := pgbouncer.Start(ctx, pgbouncer.Options{ServerHost: "127.0.0.1", ServerPort: port, User: u.User.Username(), Password: pw, PoolSize: 2})
	require.NoError(t, err)
	defer b.Stop()

	pool, err := pgdb.Connect(ctx, pgdb.Config{URL: b.URL(db.Name), MaxConns: 8, Pooler: true})
	require.NoError(t, err)
	defer pool.Close()
	for i := range 20 {
		var serverPort int
		require.NoError(t, pgdb.InTx(ctx, pool, func(tx pgx.Tx) error {
			return tx.QueryRow(ctx, "SELECT current_setting('port')::int + $1 - $1", i).Scan(&serverPort)
		}))
		require.Equal(t, port, serverPort)
	}
	require.NotEqual(t, port, b.Port())
	// A single pgx connection on the URL works too: the URL carries exec mode.
	conn, err := pgx.Connect(ctx, b.URL(db.Name))
	require.NoError(t, err)
	defer conn.Close(ctx)
	var one int
	require.NoError(t, conn.QueryRow(ctx, "SELECT $1::int", 1).Scan(&one))
	require.NoError(t, conn.QueryRow(ctx, "SELECT $1::int", 1).Scan(&one))
	require.Equal(t, 1, one)
}

// TestRepointAfterPromotionKeepsClientsWorking puts a PgBouncer in front of
// the primary of a synchronous pair (pkg/pgha) and writes through one pool.
// The primary is killed and the standby promoted; after Repoint (config
// rewritten, RELOAD on the admin console) the same pool, still on
// PgBouncer's address, writes to the promoted standby, and every
// acknowledged write is there.
func TestRepointAfterPromotionKeepsClientsWorking(t *testing.T) {
	if _, err := pgbouncer.Binary(); err != nil {
		t.Skip(err)
	}
	if _, err := pglocal.BinDir(); err != nil {
		t.Skip(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	p := pgha.Start(t, pgha.Options{Sync: true})
	b, err := pgbouncer.Start(ctx, pgbouncer.Options{ServerHost: "127.0.0.1", ServerPort: p.Primary().Port(), User: "postgres", Password: "postgres", PoolSize: 4})
	require.NoError(t, err)
	defer b.Stop()
	pool, err := pgdb.Connect(ctx, pgdb.Config{URL: b.URL(pgha.DBName), MaxConns: 4, Pooler: true, ConnectTimeout: 2 * time.Second})
	require.NoError(t, err)
	defer pool.Close()
	_, err = pool.Exec(ctx, "CREATE TABLE acked (id int PRIMARY KEY)")
	require.NoError(t, err)
	serverPort := func() int {
		var port int
		if err := pool.QueryRow(ctx, "SELECT current_setting('port')::int").Scan(&port); err != nil {
			return 0
		}
		return port
	}
	require.Equal(t, p.Primary().Port(), serverPort())
	var acked []int
	for i := range 50 {
		_, err := pool.Exec(ctx, "INSERT INTO acked VALUES ($1)", i)
		require.NoError(t, err)
		acked = append(acked, i)
	}

	require.NoError(t, p.KillPrimary(ctx))
	require.NoError(t, p.Promote(ctx))
	require.NoError(t, b.Repoint(ctx, "127.0.0.1", p.Standby().Port()))
	host, port := b.Server()
	require.Equal(t, "127.0.0.1", host)
	require.Equal(t, p.Standby().Port(), port)

	// The first statements may still meet a dead server connection; the
	// pool redials PgBouncer, which now dials the new primary.
	require.Eventually(t, func() bool { return serverPort() == p.Standby().Port() }, time.Minute, 50*time.Millisecond,
		"the pool reaches the promoted standby through PgBouncer: %s", b.Logs())
	for i := 50; i < 100; i++ {
		_, err := pool.Exec(ctx, "INSERT INTO acked VALUES ($1)", i)
		require.NoError(t, err)
		acked = append(acked, i)
	}
	var ids []int
	rows, err := pool.Query(ctx, "SELECT id FROM acked ORDER BY id")
	require.NoError(t, err)
	ids, err = pgx.CollectRows(rows, pgx.RowTo[int])
	require.NoError(t, err)
	require.Equal(t, acked, ids)
}
