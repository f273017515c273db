package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
	"github.com/leasehold/leasehold/services/worker/internal/sinks"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var fastArgs = []string{"--coord.lease-ttl", "3s", "--coord.renew-interval", "1s", "--coord.live-window", "6s",
	"--coord.self-release-after", "5s", "--sinks.refresh", "200ms", "--collector.interval", "200ms", "--log-format", "text"}

func startWorker(t *testing.T, bin, id, dbURL string) *proctest.Proc {
	t.Helper()
	port, err := pglocal.FreePort()
	require.NoError(t, err)
	args := append([]string{"--id", id, "--database-url", dbURL, "--http-addr", fmt.Sprintf("127.0.0.1:%d", port)}, fastArgs...)
	args = append(args, pgtest.PoolerFlags(dbURL)...)
	p := proctest.Start(t, id, bin, nil, args...)
	p.WaitReady(20 * time.Second)
	return p
}

type receiver struct {
	mu       sync.Mutex
	secret   []byte
	got      map[string]int
	badSigs  int
	requests int
}

func (r *receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	body, _ := io.ReadAll(req.Body)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.requests++
	if !sinks.Verify(r.secret, req.Header.Get(sinks.HeaderTimestamp), body, req.Header.Get(sinks.HeaderSignature)) {
		r.badSigs++
		http.Error(w, "bad signature", http.StatusUnauthorized)
		return
	}
	var b sinks.Batch
	if err := json.Unmarshal(body, &b); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	for _, e := range b.Events {
		r.got[e.ID]++
	}
}

func (r *receiver) distinct() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.got)
}

// TestSinkDeliversEveryEventAcrossForcedTakeover: two real worker processes;
// the one delivering the webhook sink is SIGKILLed mid-stream; the other
// resumes from the saved cursor. The receiver verifies every signature and
// sees every event at least once.
func TestSinkDeliversEveryEventAcrossForcedTakeover(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	db := pgtest.NewDB(t)
	ctx := context.Background()
	rcv := &receiver{secret: []byte("0123456789abcdef-secret"), got: map[string]int{}}
	srv := httptest.NewServer(rcv)
	defer srv.Close()
	_, err := db.Pool.Exec(ctx, "INSERT INTO nodes (id) VALUES ('n1')")
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, "INSERT INTO sinks (id, url, secret) VALUES ('audit', $1, $2)", srv.URL, string(rcv.secret))
	require.NoError(t, err)

	bin := proctest.Build(t, ".")
	procs := map[string]*proctest.Proc{
		"wa": startWorker(t, bin, "wa", db.URL),
		"wb": startWorker(t, bin, "wb", db.URL),
	}
	const total = 400
	insert := func(from, to int) {
		for i := from; i < to; i++ {
			_, err := db.Pool.Exec(ctx, `INSERT INTO node_events (node_id, id, kind, gateway_id, session_epoch) VALUES ('n1', $1, 'test', 'gw', 1)`,
				fmt.Sprintf("ev-%04d", i))
			require.NoError(t, err)
			time.Sleep(2 * time.Millisecond) // the injected pace: events keep arriving while the holder is killed
		}
	}
	insert(0, 150)
	require.Eventually(t, func() bool { return rcv.distinct() >= 50 }, 20*time.Second, 20*time.Millisecond)

	var holder string
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT owner FROM leases WHERE name = 'singleton:sink:audit'").Scan(&holder))
	procs[holder].Kill()
	insert(150, total)
	require.Eventually(t, func() bool { return rcv.distinct() == total }, 30*time.Second, 50*time.Millisecond,
		"every event delivered at least once after the takeover")
	rcv.mu.Lock()
	defer rcv.mu.Unlock()
	require.Zero(t, rcv.badSigs, "every delivery carried a valid signature")
	var epoch int64
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT epoch FROM leases WHERE name = 'singleton:sink:audit'").Scan(&epoch))
	require.GreaterOrEqual(t, epoch, int64(2), "the sink changed hands")
	redelivered := 0
	for _, n := range rcv.got {
		redelivered += n - 1
	}
	t.Logf("sink takeover: %d events, %d requests, %d redelivered (at-least-once)", total, rcv.requests, redelivered)
}

// TestOnlyTheCollectorHolderExportsFleetGauges: the metrics:command-latency
// lease makes exactly one process export the fleet gauges.
func TestOnlyTheCollectorHolderExportsFleetGauges(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	db := pgtest.NewDB(t)
	_, err := db.Pool.Exec(context.Background(), "INSERT INTO nodes (id, state) VALUES ('n1', 'connected'), ('n2', 'unreachable')")
	require.NoError(t, err)
	bin := proctest.Build(t, ".")
	a := startWorker(t, bin, "wa", db.URL)
	b := startWorker(t, bin, "wb", db.URL)
	exporting := func(p *proctest.Proc) bool {
		_, body, err := p.Get("/metrics", "")
		return err == nil && strings.Contains(body, `leasehold_fleet_nodes{state="unreachable"} 1`)
	}
	require.Eventually(t, func() bool { return exporting(a) != exporting(b) }, 20*time.Second, 50*time.Millisecond,
		"exactly one worker exports the fleet gauges")
}
