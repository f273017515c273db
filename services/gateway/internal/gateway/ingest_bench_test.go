package gateway

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// BenchmarkGroupCommit measures one group commit of 20 results (the
// statement, its planning and the round trip on one connection), with the
// gateway's generic plans and with PostgreSQL's default plan cache, beside
// 50,000 finished commands. An op is one batch of 20.
//
//	cd services/gateway && go test -run '^$' -bench GroupCommit -benchtime 400x ./internal/gateway/
func BenchmarkGroupCommit(b *testing.B) {
	for _, generic := range []bool{true, false} {
		b.Run(fmt.Sprintf("generic=%v", generic), func(b *testing.B) {
			db := pgtest.NewDB(b)
			ctx := context.Background()
			registerNodes(b, db, "x", 300)
			_, err := db.Pool.Exec(ctx, `INSERT INTO commands (node_id, kind, state, finished_at) SELECT 'x-' || (i % 300), 'k', 'succeeded', compute_now() FROM generate_series(1, 50000) i`)
			require.NoError(b, err)
			const batch = 20
			_, err = db.Pool.Exec(ctx, `INSERT INTO commands (id, node_id, kind, state) SELECT 'c' || i, 'x-' || (i % 300), 'k', 'dispatched' FROM generate_series(1, $1) i`, (b.N+1)*batch)
			require.NoError(b, err)
			_, err = db.Pool.Exec(ctx, `ANALYZE`)
			require.NoError(b, err)
			pool, err := pgdb.Connect(ctx, pgdb.Config{URL: db.URL, GenericPlans: generic, Pooler: pgtest.Pooled(), MaxConns: 1})
			require.NoError(b, err)
			defer pool.Close()
			g := &Gateway{db: pool, id: "gw-bench", cfg: Config{OutputCap: 1 << 20}}
			sessions := make([]*session, 300)
			for i := range sessions {
				sessions[i] = &session{nodeID: fmt.Sprint("x-", i), epoch: 1}
			}
			now := time.Now()
			items := func(k int) []*ingestItem {
				out := make([]*ingestItem, batch)
				for j := range out {
					i := k*batch + j + 1
					out[j] = &ingestItem{kind: ingestResult, s: sessions[i%300], id: fmt.Sprint("r", i), command: fmt.Sprint("c", i),
						output: []byte("ok"), started: &now, finished: &now}
				}
				return out
			}
			b.ResetTimer()
			for k := range b.N {
				out, _, err := g.writeBatch(ctx, items(k))
				if err != nil {
					b.Fatal(err)
				}
				if out[0] != "stored" {
					b.Fatalf("outcome %q", out[0])
				}
			}
		})
	}
}
