package api

import (
	"context"
	"flag"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/lifecycle"
	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgha"
	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestReadReplicaConfig: the flag's environment variable follows the
// lifecycle convention, a bad URL or one that asks for a primary is refused
// naming the flag, and the lag bound is checked. Unset, nothing changes.
func TestReadReplicaConfig(t *testing.T) {
	var c Config
	fs := flag.NewFlagSet("api", flag.ContinueOnError)
	c.RegisterFlags("", fs)
	require.NoError(t, fs.Parse(nil))
	c.Tokens = "viewer:" + viewerToken
	require.NoError(t, c.Validate())
	require.Empty(t, c.ReadDatabaseURL, "off by default")
	require.Equal(t, 5*time.Second, c.ReadReplicaMaxLag)

	require.Equal(t, "LEASEHOLD_API_READ_DATABASE_URL", lifecycle.EnvName("api.read-database-url"))
	t.Setenv("LEASEHOLD_API_READ_DATABASE_URL", "postgres://u:secret-pw@standby:5432/lh")
	t.Setenv("LEASEHOLD_API_READ_REPLICA_MAX_LAG", "2s")
	require.NoError(t, lifecycle.ApplyEnv(fs))
	require.Equal(t, "postgres://u:secret-pw@standby:5432/lh", c.ReadDatabaseURL)
	require.Equal(t, 2*time.Second, c.ReadReplicaMaxLag)
	require.NoError(t, c.Validate())

	for url, want := range map[string]string{
		"postgres://u:secret-pw@standby:notaport/lh":                            "--api.read-database-url",
		"postgres://u:secret-pw@standby/lh?target_session_attrs=read-write":     "target_session_attrs=read-write contradicts a read replica",
		"postgres://u:secret-pw@a,b/lh?target_session_attrs=primary":            "target_session_attrs=primary contradicts a read replica",
		"postgres://u:secret-pw@standby/lh?default_transaction_read_only=maybe": "", // the server judges its own settings
	} {
		bad := c
		bad.ReadDatabaseURL = url
		err := bad.Validate()
		if want == "" {
			require.NoError(t, err, url)
			continue
		}
		require.ErrorContains(t, err, want, url)
		require.ErrorContains(t, err, "--api.read-database-url", url)
		require.NotContains(t, err.Error(), "secret-pw", "the password stays out of the message")
	}
	bad := c
	bad.ReadReplicaMaxLag = time.Millisecond
	require.ErrorContains(t, bad.Validate(), "--api.read-replica-max-lag")
}

// replicaFallbacks sums leasehold_api_read_replica_fallbacks_total for
// reason ("" for every reason).
func (b *bundle) replicaFallbacks(reason string) float64 {
	b.t.Helper()
	mfs, err := b.reg.Gather()
	require.NoError(b.t, err)
	var n float64
	for _, mf := range mfs {
		if mf.GetName() != "leasehold_api_read_replica_fallbacks_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "reason" && (reason == "" || l.GetValue() == reason) {
					n += m.GetCounter().GetValue()
				}
			}
		}
	}
	return n
}

// replicaUp reads leasehold_api_read_replica_up.
func (b *bundle) replicaUp() float64 {
	mfs, err := b.reg.Gather()
	require.NoError(b.t, err)
	for _, mf := range mfs {
		if mf.GetName() == "leasehold_api_read_replica_up" && len(mf.GetMetric()) == 1 {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	return -1
}

// TestReadReplicaErrorFallsBackToThePrimary: a replica that refuses
// connections never fails a list. Forced usable (as if its last probe had
// passed), each list's attempt on it fails, the primary answers, the
// counter moves with reason "error", and the warning is logged once
// however many calls fell back within the minute.
func TestReadReplicaErrorFallsBackToThePrimary(t *testing.T) {
	t.Parallel()
	port, err := pglocal.FreePort()
	require.NoError(t, err)
	b := setup(t, func(c *Config, _ *http.Transport) {
		c.ReadDatabaseURL = "postgres://u:p@127.0.0.1:" + strconv.Itoa(port) + "/lh?sslmode=disable"
		c.readProbeInterval = time.Hour // the probe at start only
	})
	r := b.svc.reads
	require.NotNil(t, r)
	require.Eventually(t, func() bool { return r.detail()["last_error"] != "" }, 20*time.Second, 10*time.Millisecond,
		"the probe at start finds nothing listening")
	require.Zero(t, b.replicaUp())
	b.registerNode("node-err-1", nil)

	before := b.replicaFallbacks(fallbackError)
	for range 3 {
		r.usable.Store(true)
		r.lag.Store(0)
		resp, err := b.viewer.ListNodes(ctxT(t), connect.NewRequest(&controlv1.ListNodesRequest{}))
		require.NoError(t, err)
		require.Len(t, resp.Msg.GetNodes(), 1)
		require.False(t, r.usable.Load(), "a failed attempt keeps the lists on the primary until the next good probe")
	}
	require.Equal(t, before+3, b.replicaFallbacks(fallbackError))
	require.Equal(t, 1, strings.Count(b.logs.String(), "list served by the primary"), b.logs.String())

	// Known unusable: straight to the primary, counted as unavailable.
	_, err = b.admin.ListAuditEvents(ctxT(t), connect.NewRequest(&controlv1.ListAuditEventsRequest{}))
	require.NoError(t, err)
	require.Positive(t, b.replicaFallbacks(fallbackUnavailable))
}

// replicaBundle is an api whose primary and read replica are a real pgha
// pair: the primary and its asynchronous streaming standby.
type replicaBundle struct {
	*bundle
	pair *pgha.Pair
}

func skipWithoutPair(t *testing.T) {
	t.Helper()
	if _, err := pglocal.BinDir(); err != nil {
		t.Skip(err)
	}
	if pgtest.Pooled() {
		t.Skip("starts its own servers on direct URLs: runs once, in the default mode")
	}
	if testing.Short() {
		t.Skip("starts a primary and a standby")
	}
}

func setupReplica(t *testing.T, maxLag time.Duration) *replicaBundle {
	t.Helper()
	pair := pgha.Start(t, pgha.Options{})
	primary, err := pgdb.Connect(ctxT(t), pgdb.Config{URL: pair.PrimaryURL(), AppName: "leasehold-api-test", Setting: "--database-url"})
	require.NoError(t, err)
	t.Cleanup(primary.Close)
	b := setupWith(t, func(d *Deps) {
		d.DB, d.NotifyURL, d.ID, d.MaxConns = primary, pair.PrimaryURL(), "t1", 4
	}, func(c *Config, _ *http.Transport) {
		c.ReadDatabaseURL = pair.StandbyURL()
		c.ReadReplicaMaxLag = maxLag
		c.readProbeInterval = 100 * time.Millisecond
	})
	return &replicaBundle{bundle: b, pair: pair}
}

// standbyScans is how many scans the standby itself ran on table: its own
// statistics, which count only the reads made on it.
func (rb *replicaBundle) standbyScans(table string) int64 {
	rb.t.Helper()
	conn, err := pgx.Connect(ctxT(rb.t), rb.pair.StandbyURL())
	require.NoError(rb.t, err)
	defer conn.Close(context.Background())
	var n int64
	require.NoError(rb.t, conn.QueryRow(ctxT(rb.t),
		"SELECT coalesce(sum(coalesce(seq_scan, 0) + coalesce(idx_scan, 0)), 0)::bigint FROM pg_stat_user_tables WHERE relname = $1",
		table).Scan(&n))
	return n
}

func (rb *replicaBundle) listNodeIDs() []string {
	rb.t.Helper()
	resp, err := rb.viewer.ListNodes(ctxT(rb.t), connect.NewRequest(&controlv1.ListNodesRequest{}))
	require.NoError(rb.t, err)
	var ids []string
	for _, n := range resp.Msg.GetNodes() {
		ids = append(ids, n.GetId())
	}
	return ids
}

// TestListsReadFromTheStandby: with --api.read-database-url on a real
// streaming standby, ListNodes is served by the standby (its connections
// carry the read pool's application_name, its own statistics count the
// scans of nodes, and a node written on the primary while replication is
// paused is missing from the list though GetNode, on the primary, finds
// it); once replication resumes the node appears in the list.
func TestListsReadFromTheStandby(t *testing.T) {
	skipWithoutPair(t)
	t.Parallel()
	rb := setupReplica(t, time.Hour) // a paused standby stays in use: its lag is what this test shows
	rb.registerNode("node-a", nil)
	require.Eventually(t, func() bool { return rb.replicaUp() == 1 }, 20*time.Second, 20*time.Millisecond)
	require.Eventually(t, func() bool { return slices.Contains(rb.listNodeIDs(), "node-a") }, 20*time.Second, 20*time.Millisecond,
		"the node appears once the standby replayed it")

	scans := rb.standbyScans("nodes")
	for range 5 {
		rb.listNodeIDs()
	}
	require.Eventually(t, func() bool { return rb.standbyScans("nodes") >= scans+5 }, 20*time.Second, 20*time.Millisecond,
		"the standby counts the lists' scans of nodes")
	var readers int
	conn, err := pgx.Connect(ctxT(t), rb.pair.StandbyURL())
	require.NoError(t, err)
	defer conn.Close(context.Background())
	require.NoError(t, conn.QueryRow(ctxT(t), "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'leasehold-api-read:t1'").Scan(&readers))
	require.Positive(t, readers, "the read pool is connected to the standby")
	var readOnly string
	require.NoError(t, rb.svc.reads.pool.QueryRow(ctxT(t), "SHOW default_transaction_read_only").Scan(&readOnly))
	require.Equal(t, "on", readOnly, "the read pool's sessions are read-only")

	require.NoError(t, rb.pair.PauseReplication(ctxT(t)))
	rb.registerNode("node-b", nil)
	got, err := rb.viewer.GetNode(ctxT(t), connect.NewRequest(&controlv1.GetNodeRequest{NodeId: "node-b"}))
	require.NoError(t, err, "a get reads the primary: a write is read back at once")
	require.Equal(t, "node-b", got.Msg.GetNode().GetId())
	require.Equal(t, []string{"node-a"}, rb.listNodeIDs(), "the list is the standby's, which has not received node-b")

	require.NoError(t, rb.pair.ResumeReplication(ctxT(t)))
	require.Eventually(t, func() bool { return slices.Contains(rb.listNodeIDs(), "node-b") }, 20*time.Second, 20*time.Millisecond,
		"node-b appears once replayed")
	require.Zero(t, rb.replicaFallbacks(fallbackError), "no list failed on the standby")
}

// TestListsLeaveALaggingStandby: a standby whose replay lag passes
// --api.read-replica-max-lag (its WAL receiver stopped, so it ages) serves
// no list: they go to the primary, a node written there is listed, and the
// lag fallbacks are counted; replication resumed, lists go back to it.
func TestListsLeaveALaggingStandby(t *testing.T) {
	skipWithoutPair(t)
	t.Parallel()
	rb := setupReplica(t, 500*time.Millisecond)
	rb.registerNode("node-a", nil)
	require.Eventually(t, func() bool { return slices.Contains(rb.listNodeIDs(), "node-a") && rb.replicaUp() == 1 },
		20*time.Second, 20*time.Millisecond)

	require.NoError(t, rb.pair.PauseReplication(ctxT(t)))
	rb.registerNode("node-b", nil)
	require.Eventually(t, func() bool { return slices.Contains(rb.listNodeIDs(), "node-b") }, 20*time.Second, 20*time.Millisecond,
		"past the lag bound the primary serves the list")
	require.Positive(t, rb.replicaFallbacks(fallbackLag))
	require.Zero(t, rb.replicaUp())

	require.NoError(t, rb.pair.ResumeReplication(ctxT(t)))
	require.Eventually(t, func() bool { return rb.replicaUp() == 1 }, 20*time.Second, 20*time.Millisecond,
		"caught up, the standby serves the lists again")
	scans := rb.standbyScans("nodes")
	require.Contains(t, rb.listNodeIDs(), "node-b")
	require.Eventually(t, func() bool { return rb.standbyScans("nodes") > scans }, 20*time.Second, 20*time.Millisecond)
}

// TestListsSurviveTheStandbyStopping: with the standby stopped every list
// RPC still answers, from the primary, and the fallback counter moves;
// once the standby is started again the lists go back to it, the api never
// restarted.
func TestListsSurviveTheStandbyStopping(t *testing.T) {
	skipWithoutPair(t)
	t.Parallel()
	rb := setupReplica(t, 5*time.Second)
	rb.registerNode("node-a", nil)
	require.Eventually(t, func() bool { return slices.Contains(rb.listNodeIDs(), "node-a") && rb.replicaUp() == 1 },
		20*time.Second, 20*time.Millisecond)
	before := rb.replicaFallbacks("")

	require.NoError(t, rb.pair.Standby().Stop(ctxT(t), pglocal.StopFast))
	rb.registerNode("node-b", nil)
	require.ElementsMatch(t, []string{"node-a", "node-b"}, rb.listNodeIDs(), "the primary answers, with what it has")
	ctx := ctxT(t)
	_, err := rb.viewer.ListCommands(ctx, connect.NewRequest(&controlv1.ListCommandsRequest{}))
	require.NoError(t, err)
	_, err = rb.viewer.ListRuns(ctx, connect.NewRequest(&controlv1.ListRunsRequest{}))
	require.NoError(t, err)
	_, err = rb.admin.ListAuditEvents(ctx, connect.NewRequest(&controlv1.ListAuditEventsRequest{}))
	require.NoError(t, err)
	_, err = rb.viewer.ListPools(ctx, connect.NewRequest(&controlv1.ListPoolsRequest{}))
	require.NoError(t, err)
	_, err = rb.viewer.ListPoolLeases(ctx, connect.NewRequest(&controlv1.ListPoolLeasesRequest{}))
	require.NoError(t, err)
	require.GreaterOrEqual(t, rb.replicaFallbacks(""), before+6, "every list of the stopped standby fell back")
	require.Zero(t, rb.replicaUp())

	require.NoError(t, rb.pair.Standby().Start(ctxT(t)))
	require.Eventually(t, func() bool { return rb.replicaUp() == 1 }, 20*time.Second, 20*time.Millisecond,
		"the probe finds the standby back")
	scans := rb.standbyScans("nodes")
	require.ElementsMatch(t, []string{"node-a", "node-b"}, rb.listNodeIDs(), "the standby caught up while it was away")
	require.Eventually(t, func() bool { return rb.standbyScans("nodes") > scans }, 20*time.Second, 20*time.Millisecond,
		"the standby counts the list's scan")
}
