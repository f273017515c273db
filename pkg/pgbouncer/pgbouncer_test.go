package pgbouncer_test

import (
	"context"
	"net/url"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgbouncer"
	"github.com/leasehold/leasehold/pkg/pgdb"
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
