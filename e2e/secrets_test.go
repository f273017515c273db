package e2e

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/daemon"
	"github.com/leasehold/leasehold/pkg/fleettest"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestSecretsNeverLogged runs a gateway and a worker at debug level with a
// health token, node credentials, a sink secret delivering events, a node
// that offers another node's credential, and /healthz/detail calls with the
// right and a wrong token; then no byte of any secret may appear in what
// either process logged. (The refusals themselves are tested in
// services/gateway: TestHelloRefusals and friends.)
func TestSecretsNeverLogged(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	db := pgtest.NewDB(t)
	ctx := context.Background()
	const healthToken = "hT0k3n-never-logged-7f3a9c"
	const wrongToken = "wr0ng-t0ken-never-logged-1b2c"
	const sinkSecret = "s1nk-s3cret-never-logged-0123456789"
	var delivered atomic.Int64
	sink := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		delivered.Add(1)
	}))
	defer sink.Close()
	_, err := db.Pool.Exec(ctx, "INSERT INTO sinks (id, url, secret) VALUES ('audit', $1, $2)", sink.URL, sinkSecret)
	require.NoError(t, err)

	gw := fleettest.StartGateway(t, db.URL, "gw_sec", append(slices.Clone(fleettest.FastGateway), "--log-level", "debug", "--health-token", healthToken)...)
	w := fleettest.StartService(t, "worker", db.URL, "w_sec", append(slices.Clone(fleettest.FastCoord), "--log-level", "debug", "--health-token", healthToken,
		"--sinks.refresh", "200ms", "--sinks.allow-loopback")...)
	ids, creds := fleettest.RegisterNodes(t, db.Pool, "snode", 3)
	// Nodes 0 and 1 connect properly; node 2 says Hello with node 1's
	// credential and must be refused.
	nodes := startNodes(t, "http://"+gw.Listen, ids[:2], creds[:2])
	impostor, err := daemon.New(daemon.Config{Address: "http://" + gw.Listen, NodeID: ids[2], Credential: creds[1],
		BackoffBase: 100 * time.Millisecond, BackoffMax: 200 * time.Millisecond,
		Handler: func(context.Context, *nodev1.Command) daemon.Outcome { return daemon.Outcome{} }})
	require.NoError(t, err)
	ictx, stopImpostor := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = impostor.Run(ictx) }()
	defer func() { stopImpostor(); <-done }()

	require.Eventually(t, func() bool {
		n, err := queryInt(db.Pool, `SELECT count(*) FROM node_sessions WHERE state = 'connected'`)
		return err == nil && n == 2
	}, 20*time.Second, 50*time.Millisecond)
	// Commands produce results and events for the sink.
	_, err = db.Pool.Exec(ctx, `INSERT INTO commands (node_id, kind) SELECT n, 'exec' FROM unnest($1::text[]) n, generate_series(1, 5)`, ids[:2])
	require.NoError(t, err)
	waitCompleted(t, db.Pool, nodes, mustIDs(t, db), 30*time.Second)
	for _, p := range []interface {
		Get(string, string) (int, string, error)
	}{gw, w} {
		code, _, err := p.Get("/healthz/detail", healthToken)
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, code)
		for _, tok := range []string{"", wrongToken, healthToken + "x", strings.ToUpper(healthToken)} {
			code, body, err := p.Get("/healthz/detail", tok)
			require.NoError(t, err)
			require.Equal(t, http.StatusUnauthorized, code, "token %q", tok)
			require.NotContains(t, body, healthToken)
		}
	}
	time.Sleep(time.Second) // a window for the impostor to retry: what is checked is that no session opens
	n, err := queryInt(db.Pool, `SELECT count(*) FROM node_sessions WHERE node_id = $1`, ids[2])
	require.NoError(t, err)
	require.Zero(t, n, "a node's credential must not open a session for another node")

	secrets := map[string]string{"health token": healthToken, "wrong token": wrongToken, "sink secret": sinkSecret,
		"impostor's credential": creds[1]}
	for i, c := range creds {
		secrets["credential of "+ids[i]] = c
	}
	for name, p := range map[string]interface{ Logs() string }{"gateway": gw, "worker": w} {
		logs := p.Logs()
		require.NotEmpty(t, logs)
		for what, s := range secrets {
			require.NotContains(t, logs, s, "%s logged the %s", name, what)
		}
		t.Logf("%s: %d bytes of debug logs, none of %d secrets in them", name, len(logs), len(secrets))
	}
	t.Logf("sink deliveries during the run: %d", delivered.Load())
}

func mustIDs(t *testing.T, db *pgtest.DB) []string {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), `SELECT id FROM commands`)
	require.NoError(t, err)
	defer rows.Close()
	var ids []string
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		ids = append(ids, id)
	}
	return ids
}
