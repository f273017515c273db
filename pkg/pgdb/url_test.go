package pgdb_test

import (
	"context"
	"net/url"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestCheckURLRefusesSeveralHostsThatMayLandOnAStandby: a URL listing
// several servers is accepted only with target_session_attrs read-write or
// primary, in URL and keyword/value form; the refusal names the setting, the
// hosts and the fix, and PoolConfig refuses it the same way unless the pool
// is read-only.
func TestCheckURLRefusesSeveralHostsThatMayLandOnAStandby(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		url   string
		ok    bool
		hosts []string
		attrs string
	}{
		{"postgres://u:p@db1:5432/lh", true, []string{"db1:5432"}, "any"},
		{"postgres://u:p@db1:5432/lh?sslmode=prefer", true, []string{"db1:5432"}, "any"}, // TLS then plain: one server
		{"postgres://u:p@db1:5432/lh?target_session_attrs=read-only", true, []string{"db1:5432"}, "read-only"},
		{"postgres://u:p@db1:5432,db2:5433/lh", false, []string{"db1:5432", "db2:5433"}, "any"},
		{"postgres://u:p@db1,db2/lh?target_session_attrs=any", false, []string{"db1:5432", "db2:5432"}, "any"},
		{"postgres://u:p@db1,db2/lh?target_session_attrs=prefer-standby", false, []string{"db1:5432", "db2:5432"}, "prefer-standby"},
		{"postgres://u:p@db1,db2/lh?target_session_attrs=standby", false, []string{"db1:5432", "db2:5432"}, "standby"},
		{"postgres://u:p@db1:5432,db2:5433/lh?target_session_attrs=read-write", true, []string{"db1:5432", "db2:5433"}, "read-write"},
		{"postgres://u:p@db1:5432,db2:5433/lh?target_session_attrs=primary", true, []string{"db1:5432", "db2:5433"}, "primary"},
		{"host=db1,db2 port=5432,5433 user=u dbname=lh", false, []string{"db1:5432", "db2:5433"}, "any"},
		{"host=db1,db2 user=u dbname=lh target_session_attrs=read-write", true, []string{"db1:5432", "db2:5432"}, "read-write"},
	} {
		cc, err := pgconn.ParseConfig(tc.url)
		require.NoError(t, err, tc.url)
		require.Equal(t, tc.hosts, pgdb.Hosts(cc), tc.url)
		require.Equal(t, tc.attrs, pgdb.TargetSessionAttrs(cc), tc.url)
		require.Equal(t, tc.ok, pgdb.WritesOnlyToPrimary(cc), tc.url)

		err = pgdb.CheckURL(tc.url, "--database-url")
		_, poolErr := pgdb.PoolConfig(pgdb.Config{URL: tc.url, Setting: "--database-url"})
		_, readOnlyErr := pgdb.PoolConfig(pgdb.Config{URL: tc.url, ReadOnly: true})
		require.NoError(t, readOnlyErr, "a read-only pool takes any URL: %s", tc.url)
		if tc.ok {
			require.NoError(t, err, tc.url)
			require.NoError(t, poolErr, tc.url)
			continue
		}
		for _, e := range []error{err, poolErr} {
			require.ErrorIs(t, e, pgdb.ErrMultiHostAnyServer, tc.url)
			var ue *pgdb.URLError
			require.ErrorAs(t, e, &ue)
			require.Equal(t, "--database-url", ue.Setting)
			require.Contains(t, e.Error(), "--database-url lists several hosts without target_session_attrs=read-write")
			require.Contains(t, e.Error(), tc.hosts[0]+", "+tc.hosts[1])
		}
	}
}

// TestCheckURLNamesTheSettingOfAnUnparsableURL.
func TestCheckURLNamesTheSettingOfAnUnparsableURL(t *testing.T) {
	t.Parallel()
	err := pgdb.CheckURL("postgres://u:p@db1/lh?target_session_attrs=sometimes", "--listen-database-url")
	require.Error(t, err)
	require.Contains(t, err.Error(), "--listen-database-url")
	require.Contains(t, err.Error(), "target_session_attrs")
	_, err = pgdb.PoolConfig(pgdb.Config{})
	require.EqualError(t, err, "database url is empty")
}

// TestConnectAcceptsThePrimary: the check at start passes on a primary, and
// a multi-host URL whose first host is down lands on the live one.
func TestConnectAcceptsThePrimary(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	pool, err := pgdb.Connect(ctx, pgdb.Config{URL: db.URL, Setting: "--database-url", Pooler: pgtest.Pooled()})
	require.NoError(t, err)
	pool.Close()

	dead, err := pglocal.FreePort()
	require.NoError(t, err)
	u, err := url.Parse(db.URL)
	require.NoError(t, err)
	live := u.Host
	u.Host = "127.0.0.1:" + strconv.Itoa(dead) + "," + live
	q := u.Query()
	q.Set("target_session_attrs", "read-write")
	u.RawQuery = q.Encode()
	pool, err = pgdb.Connect(ctx, pgdb.Config{URL: u.String(), Setting: "--database-url", Pooler: pgtest.Pooled()})
	require.NoError(t, err)
	defer pool.Close()
	var one int
	require.NoError(t, pool.QueryRow(ctx, "SELECT 1").Scan(&one))
	require.Equal(t, []string{"127.0.0.1:" + strconv.Itoa(dead), live}, pgdb.Hosts(&pool.Config().ConnConfig.Config))
}
