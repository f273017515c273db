package cmdstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/cmdstore"
	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestInsert(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	_, err := db.Exec(ctx, `INSERT INTO nodes (id) VALUES ('n1'), ('gone'); UPDATE nodes SET state = 'revoked' WHERE id = 'gone'`)
	require.NoError(t, err)
	insert := func(c cmdstore.Command) (cmdstore.Inserted, error) {
		var in cmdstore.Inserted
		err := pgdb.InTx(ctx, db, func(tx pgx.Tx) error {
			var err error
			in, err = cmdstore.Insert(ctx, tx, c)
			return err
		})
		return in, err
	}
	c := cmdstore.Command{NodeID: "n1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`), Timeout: time.Hour, IdempotencyKey: "k1"}
	first, err := insert(c)
	require.NoError(t, err)
	require.True(t, first.Created)
	var left time.Duration
	require.NoError(t, db.QueryRow(ctx, `SELECT extract(epoch FROM deadline - compute_now())::float8 * 1e9 FROM commands WHERE id = $1`, first.ID).Scan(&left))
	require.InDelta(t, time.Hour, left, float64(time.Minute), "the deadline counts from compute_now()")

	again, err := insert(c)
	require.NoError(t, err)
	require.False(t, again.Created)
	require.Equal(t, first.ID, again.ID)

	other := c
	other.Payload = []byte(`{"argv":["false"]}`)
	diff, err := insert(other)
	require.NoError(t, err)
	require.Equal(t, first.ID, diff.ID)
	require.Equal(t, c.Payload, diff.Payload, "the stored content is returned, for the caller to compare")

	keyless := c
	keyless.IdempotencyKey = ""
	a, err := insert(keyless)
	require.NoError(t, err)
	b, err := insert(keyless)
	require.NoError(t, err)
	require.NotEqual(t, a.ID, b.ID, "without a key every insert is a new command")

	_, err = insert(cmdstore.Command{NodeID: "gone", Kind: "exec", Timeout: time.Hour})
	require.ErrorIs(t, err, cmdstore.ErrNodeRevoked)
	_, err = insert(cmdstore.Command{NodeID: "nobody", Kind: "exec", Timeout: time.Hour})
	require.ErrorIs(t, err, cmdstore.ErrNodeNotFound)
	var n int
	require.NoError(t, db.QueryRow(ctx, `SELECT count(*) FROM commands`).Scan(&n))
	require.Equal(t, 3, n)
}

func TestInsertMany(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	_, err := db.Exec(ctx, `INSERT INTO nodes (id) VALUES ('n1'), ('n2'), ('gone'); UPDATE nodes SET state = 'revoked' WHERE id = 'gone'`)
	require.NoError(t, err)
	many := func(cmds []cmdstore.Command) ([]cmdstore.Inserted, []error, error) {
		var (
			in      []cmdstore.Inserted
			refused []error
		)
		err := pgdb.InTx(ctx, db, func(tx pgx.Tx) error {
			var err error
			in, refused, err = cmdstore.InsertMany(ctx, tx, cmds)
			return err
		})
		return in, refused, err
	}
	cmd := func(node, key string) cmdstore.Command {
		return cmdstore.Command{NodeID: node, Kind: "exec", Payload: []byte(`{"argv":["true"]}`), Timeout: time.Hour, IdempotencyKey: key}
	}
	// A key taken before the batch returns the existing command.
	prior, _, err := many([]cmdstore.Command{cmd("n2", "k2")})
	require.NoError(t, err)
	require.True(t, prior[0].Created)

	in, refused, err := many([]cmdstore.Command{cmd("n1", "k1"), cmd("gone", "k1"), cmd("missing", "k1"), cmd("n2", "k2"), cmd("n2", "k3")})
	require.NoError(t, err)
	require.True(t, in[0].Created)
	require.NoError(t, refused[0])
	require.ErrorIs(t, refused[1], cmdstore.ErrNodeRevoked)
	require.ErrorIs(t, refused[2], cmdstore.ErrNodeNotFound)
	require.False(t, in[3].Created)
	require.Equal(t, prior[0].ID, in[3].ID)
	require.True(t, in[4].Created)
	var left time.Duration
	require.NoError(t, db.QueryRow(ctx, `SELECT extract(epoch FROM deadline - compute_now())::float8 * 1e9 FROM commands WHERE id = $1`, in[4].ID).Scan(&left))
	require.InDelta(t, time.Hour, left, float64(time.Minute), "the deadline counts from compute_now()")
	var n int
	require.NoError(t, db.QueryRow(ctx, `SELECT count(*) FROM commands`).Scan(&n))
	require.Equal(t, 3, n, "n2/k2 once, n1/k1, n2/k3")

	// Without a key nothing is written.
	_, _, err = many([]cmdstore.Command{cmd("n1", "k9"), cmd("n1", "")})
	require.ErrorIs(t, err, cmdstore.ErrKeyRequired)
	require.NoError(t, db.QueryRow(ctx, `SELECT count(*) FROM commands`).Scan(&n))
	require.Equal(t, 3, n)
}
