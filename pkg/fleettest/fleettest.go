// Package fleettest starts the real leasehold services as OS processes for
// end-to-end tests and benches: gateways, workers, schedulers and the api,
// built from this repository, with registered nodes to connect.
package fleettest

import (
	"context"
	"fmt"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

// Root is the repository's root directory.
func Root() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// Binary builds (once per test binary) the named service and returns its path.
func Binary(t testing.TB, service string) string {
	t.Helper()
	return proctest.Build(t, filepath.Join(Root(), "services", service))
}

// Addr returns a loopback address for a process to listen on: a port that
// was free a moment ago, outside the kernel's ephemeral range, and that no
// earlier Addr or FreePort call in this process returned (ports.go).
func Addr(t testing.TB) string {
	t.Helper()
	port, err := FreePort()
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("127.0.0.1:%d", port)
}

// FastCoord are reconcile-runtime timings for tests about ordering rather
// than the default durations: TTL 3 s, renew 1 s.
var FastCoord = []string{"--coord.lease-ttl", "3s", "--coord.renew-interval", "1s", "--coord.live-window", "6s",
	"--coord.statement-timeout", "1s", "--coord.self-release-after", "5s", "--coord.poll-interval", "50ms",
	"--coord.claim-ttl", "5s"}

// FastGateway are gateway timings for tests: lease TTL 2 s renewed every
// 500 ms, 6 s session lease.
var FastGateway = []string{"--gateway.lease-ttl", "2s", "--gateway.lease-renew", "500ms", "--gateway.session-lease", "6s",
	"--gateway.liveness-interval", "200ms", "--gateway.heartbeat-interval", "1s", "--gateway.dispatch-poll", "200ms",
	"--gateway.drain-max-delay", "1s", "--gateway.drain-grace", "1s"}

// DBFlags are the extra service flags for dbURL (a pgtest URL) in the
// current pgtest mode: nothing when tests reach PostgreSQL directly;
// --pooler and --listen-database-url <direct URL> through PgBouncer; only
// --pooler through PgBouncer without LISTEN (LEASEHOLD_TEST_PGBOUNCER=nolisten).
// StartGateway and StartService add them; tests that start processes
// themselves append them.
func DBFlags(dbURL string) []string { return pgtest.PoolerFlags(dbURL) }

// Gateway is a running gateway process.
type Gateway struct {
	*proctest.Proc
	// Listen is its node-stream address.
	Listen string
}

// URL is the gateway's h2c base URL.
func (g Gateway) URL() string { return "http://" + g.Listen }

// StartGateway runs a gateway process with id name against dbURL.
func StartGateway(t testing.TB, dbURL, name string, extra ...string) Gateway {
	t.Helper()
	listen := Addr(t)
	args := append([]string{"--database-url", dbURL, "--http-addr", Addr(t), "--listen-addr", listen, "--id", name,
		"--log-format", "text"}, DBFlags(dbURL)...)
	args = append(args, extra...)
	p := proctest.Start(t, name, Binary(t, "gateway"), nil, args...)
	p.WaitReady(30 * time.Second)
	return Gateway{Proc: p, Listen: listen}
}

// StartService runs service (worker, scheduler, api, …) with id name.
func StartService(t testing.TB, service, dbURL, name string, extra ...string) *proctest.Proc {
	t.Helper()
	args := append([]string{"--database-url", dbURL, "--http-addr", Addr(t), "--id", name, "--log-format", "text"}, DBFlags(dbURL)...)
	args = append(args, extra...)
	p := proctest.Start(t, name, Binary(t, service), nil, args...)
	p.WaitReady(30 * time.Second)
	return p
}

// RegisterNodes inserts n nodes named prefix-<i> with fresh credentials and
// returns their ids and credentials (stored hashed, as the api does).
func RegisterNodes(t testing.TB, db *pgxpool.Pool, prefix string, n int) (ids, creds []string) {
	t.Helper()
	hashes := make([][]byte, n)
	for i := range n {
		c, err := nodeauth.NewCredential()
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, fmt.Sprintf("%s-%d", prefix, i))
		creds = append(creds, c)
		hashes[i] = nodeauth.Hash(c)
	}
	ctx := context.Background()
	if _, err := db.Exec(ctx, `INSERT INTO nodes (id) SELECT unnest($1::text[])`, ids); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, `INSERT INTO node_credentials (node_id, credential_hash) SELECT * FROM unnest($1::text[], $2::bytea[])`, ids, hashes); err != nil {
		t.Fatal(err)
	}
	return ids, creds
}
