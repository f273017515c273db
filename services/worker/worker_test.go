package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
	"github.com/leasehold/leasehold/services/worker/internal/sinks"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var fastArgs = []string{"--coord.lease-ttl", "3s", "--coord.renew-interval", "1s", "--coord.live-window", "6s",
	"--coord.self-release-after", "5s", "--sinks.refresh", "200ms", "--collector.interval", "200ms", "--log-format", "text"}

func startWorker(t *testing.T, bin, id, dbURL string, extra ...string) *proctest.Proc {
	t.Helper()
	port, err := pglocal.FreePort()
	require.NoError(t, err)
	args := append([]string{"--id", id, "--database-url", dbURL, "--http-addr", fmt.Sprintf("127.0.0.1:%d", port)}, fastArgs...)
	args = append(args, extra...)
	args = append(args, pgtest.PoolerFlags(dbURL)...)
	p := proctest.Start(t, id, bin, nil, args...)
	p.WaitReady(20 * time.Second)
	return p
}

// receiver checks every delivery twice: with the Standard Webhooks
// reference library (an implementation of the spec independent of ours)
// and with the legacy X-Leasehold-Signature.
type receiver struct {
	mu       sync.Mutex
	secret   []byte // as stored in the sinks row
	got      map[string]int
	ids      map[string]string // webhook-id -> the events it carried
	badSigs  int
	badIDs   int
	requests int
}

func newReceiver(secret string) *receiver {
	return &receiver{secret: []byte(secret), got: map[string]int{}, ids: map[string]string{}}
}

func (r *receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	body, _ := io.ReadAll(req.Body)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.requests++
	// The library takes a whsec_ secret as is and any other secret as
	// "whsec_" + base64(secret), as docs/api.md tells receivers.
	whsec := string(r.secret)
	if !strings.HasPrefix(whsec, "whsec_") {
		whsec = "whsec_" + base64.StdEncoding.EncodeToString(r.secret)
	}
	wh, err := standardwebhooks.NewWebhook(whsec)
	if err != nil {
		panic(err)
	}
	if err := wh.Verify(body, req.Header); err != nil {
		r.badSigs++
		http.Error(w, "bad signature: "+err.Error(), http.StatusUnauthorized)
		return
	}
	if !strings.HasPrefix(string(r.secret), "whsec_") &&
		!sinks.Verify(r.secret, req.Header.Get(sinks.HeaderLegacyTimestamp), body, req.Header.Get(sinks.HeaderLegacySignature)) {
		r.badSigs++
		http.Error(w, "bad legacy signature", http.StatusUnauthorized)
		return
	}
	var b sinks.Batch
	if err := json.Unmarshal(body, &b); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var evs []string
	for _, e := range b.Events {
		r.got[e.ID]++
		evs = append(evs, e.ID)
	}
	id := req.Header.Get("webhook-id")
	if prev, seen := r.ids[id]; (seen && prev != strings.Join(evs, ",")) || id != b.ID {
		r.badIDs++ // one id, one set of events
	}
	r.ids[id] = strings.Join(evs, ",")
}

func (r *receiver) requestCount() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.requests
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
	rcv := newReceiver("0123456789abcdef-secret")
	srv := httptest.NewServer(rcv)
	defer srv.Close()
	_, err := db.Pool.Exec(ctx, "INSERT INTO nodes (id) VALUES ('n1')")
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, "INSERT INTO sinks (id, url, secret) VALUES ('audit', $1, $2)", srv.URL, string(rcv.secret))
	require.NoError(t, err)

	bin := proctest.Build(t, ".")
	procs := map[string]*proctest.Proc{
		"wa": startWorker(t, bin, "wa", db.URL, "--sinks.allow-loopback"),
		"wb": startWorker(t, bin, "wb", db.URL, "--sinks.allow-loopback"),
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
	require.Zero(t, rcv.badIDs, "a webhook-id always names the same events")
	var epoch int64
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT epoch FROM leases WHERE name = 'singleton:sink:audit'").Scan(&epoch))
	require.GreaterOrEqual(t, epoch, int64(2), "the sink changed hands")
	redelivered := 0
	for _, n := range rcv.got {
		redelivered += n - 1
	}
	t.Logf("sink takeover: %d events, %d requests, %d redelivered (at-least-once)", total, rcv.requests, redelivered)
}

// TestSinkEgressPolicyAndStandardWebhooks: a sink whose host name
// resolves to loopback is refused at delivery (the check runs on the
// dialled address, so creating it with a name did not help), and nothing
// reaches the receiver; with --sinks.allow-loopback the same sink, with a
// whsec_ secret, is delivered and verified by the Standard Webhooks
// library.
func TestSinkEgressPolicyAndStandardWebhooks(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	db := pgtest.NewDB(t)
	ctx := context.Background()
	secret := "whsec_" + base64.StdEncoding.EncodeToString([]byte("a 32-byte key for the test sink!"))
	rcv := newReceiver(secret)
	srv := httptest.NewServer(rcv)
	defer srv.Close()
	_, port, err := net.SplitHostPort(srv.Listener.Addr().String())
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, "INSERT INTO nodes (id) VALUES ('n1')")
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, "INSERT INTO sinks (id, url, secret) VALUES ('hook', $1, $2)", "http://localhost:"+port+"/hook", secret)
	require.NoError(t, err)
	for i := range 5 {
		_, err := db.Pool.Exec(ctx, `INSERT INTO node_events (node_id, id, kind, gateway_id, session_epoch) VALUES ('n1', $1, 'test', 'gw', 1)`,
			fmt.Sprintf("ev-%d", i))
		require.NoError(t, err)
	}

	bin := proctest.Build(t, ".")
	strict := startWorker(t, bin, "ws", db.URL)
	require.Eventually(t, func() bool {
		return strings.Contains(strict.Logs(), "is a loopback address (allowed only with --sinks.allow-loopback)")
	}, 30*time.Second, 50*time.Millisecond, "the worker refuses the loopback sink and says why")
	require.Zero(t, rcv.requestCount(), "nothing reached the receiver")
	strict.Signal(syscall.SIGTERM)
	require.Equal(t, 0, strict.Wait(30*time.Second), strict.Logs())

	allowed := startWorker(t, bin, "wl", db.URL, "--sinks.allow-loopback")
	require.Eventually(t, func() bool { return rcv.distinct() == 5 }, 30*time.Second, 50*time.Millisecond, allowed.Logs())
	rcv.mu.Lock()
	defer rcv.mu.Unlock()
	require.Zero(t, rcv.badSigs, "the Standard Webhooks library verified every delivery")
	require.Zero(t, rcv.badIDs)
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
