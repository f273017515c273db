package gateway

import (
	"context"
	"testing"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/structpb"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/nodereg"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

func siteAgentWelcome(t *testing.T, s *rawSession, id, cred, site string) *nodev1.Welcome {
	t.Helper()
	require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Hello{Hello: &nodev1.Hello{
		NodeId: id, Credential: cred, Kind: nodev1.NodeKind_NODE_KIND_SITE_AGENT, SiteId: site,
	}}}))
	m, err := s.recv(t, 10*time.Second)
	require.NoError(t, err)
	require.NotNil(t, m.GetWelcome(), "want Welcome, got %v", m)
	return m.GetWelcome()
}

// nextSpec reads messages until a NodeSpecUpdate arrives.
func nextSpec(t *testing.T, s *rawSession, timeout time.Duration) *nodev1.NodeSpec {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		m, err := s.recv(t, time.Until(deadline))
		require.NoError(t, err)
		if u := m.GetNodeSpecUpdate(); u != nil {
			return u.GetSpec()
		}
	}
	t.Fatalf("no NodeSpecUpdate within %s", timeout)
	return nil
}

func TestSpecChangePushedAsNodeSpecUpdateByNotifyAndByPoll(t *testing.T) {
	t.Parallel()
	for _, notify := range []bool{true, false} {
		if notify && !pgtest.NotifyAvailable() {
			continue // LEASEHOLD_TEST_PGBOUNCER=nolisten: no LISTEN, the poll case covers it
		}
		db := pgtest.NewDB(t)
		cfg := testConfig()
		cfg.SpecPoll = 300 * time.Millisecond
		if !notify {
			cfg.SpecPoll = 200 * time.Millisecond
		}
		deps := Deps{ID: "gw_spec" + map[bool]string{true: "n", false: "p"}[notify], DB: db.Pool}
		if notify {
			deps.NotifyURL = db.DirectURL
			cfg.SpecPoll = time.Hour // only NOTIFY can deliver it in time
		}
		g := startGatewayWith(t, cfg, deps)
		cred, err := nodereg.Register(context.Background(), db.Pool, nodereg.Node{ID: "agent-1", Kind: "site_agent", SiteID: "s1"})
		require.NoError(t, err)
		s := dialRaw(t, g.Addr())
		w := siteAgentWelcome(t, s, "agent-1", cred, "s1")
		require.Nil(t, w.GetSpec().GetSiteBoot())

		start := time.Now()
		_, err = db.Pool.Exec(context.Background(),
			`UPDATE nodes SET spec = '{"site_boot":{"active":true,"epoch":"3","site_id":"s1"},"attributes":{"k":"v"}}' WHERE id = 'agent-1'`)
		require.NoError(t, err)
		spec := nextSpec(t, s, 5*time.Second)
		t.Logf("notify=%v: NodeSpecUpdate after %s", notify, time.Since(start).Round(time.Millisecond))
		require.True(t, spec.GetSiteBoot().GetActive())
		require.EqualValues(t, 3, spec.GetSiteBoot().GetEpoch())
		require.Equal(t, "v", spec.GetAttributes()["k"])

		// An update that does not change the spec pushes nothing; a later
		// change is pushed once.
		_, err = db.Pool.Exec(context.Background(), `UPDATE nodes SET spec = spec WHERE id = 'agent-1'`)
		require.NoError(t, err)
		_, err = db.Pool.Exec(context.Background(),
			`UPDATE nodes SET spec = '{"site_boot":{"active":false,"epoch":"4","site_id":"s1"}}' WHERE id = 'agent-1'`)
		require.NoError(t, err)
		spec = nextSpec(t, s, 5*time.Second)
		require.False(t, spec.GetSiteBoot().GetActive())
		require.EqualValues(t, 4, spec.GetSiteBoot().GetEpoch())
	}
}

func TestDiscoveryReportStoredOnlyAtTheCurrentBootEpoch(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	g := startGateway(t, db, testConfig())
	ctx := context.Background()
	cred, err := nodereg.Register(ctx, db.Pool, nodereg.Node{ID: "agent-1", Kind: "site_agent", SiteID: "s1"})
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `INSERT INTO leases (name, owner, epoch, expires_at) VALUES ('site:s1:boot', 'agent-1', 5, compute_now() + interval '15 seconds')`)
	require.NoError(t, err)
	s := dialRaw(t, g.Addr())
	siteAgentWelcome(t, s, "agent-1", cred, "s1")

	send := func(id string, epoch uint64, kind string) {
		payload, err := structpb.NewStruct(map[string]any{"mac": "52:54:00:12:34:56"})
		require.NoError(t, err)
		require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Event{Event: &nodev1.Event{
			EventId: id, Kind: kind, Payload: payload, BootEpoch: epoch,
		}}}))
	}
	send("discovery/old", 4, "discovery")     // an old epoch
	send("discovery/future", 6, "discovery")  // not (yet) the epoch
	send("discovery/current", 5, "discovery") // the holder at its epoch
	send("other", 4, "note")                  // other kinds are facts as before
	// A heartbeat round trip orders the checks after the events.
	require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Heartbeat{Heartbeat: &nodev1.Heartbeat{Sequence: 1}}}))
	for {
		m, err := s.recv(t, 5*time.Second)
		require.NoError(t, err)
		if m.GetHeartbeatAck() != nil {
			break
		}
	}
	ids := func() []string {
		rows, err := db.Pool.Query(ctx, "SELECT id FROM node_events WHERE node_id = 'agent-1' ORDER BY id")
		require.NoError(t, err)
		defer rows.Close()
		var out []string
		for rows.Next() {
			var id string
			require.NoError(t, rows.Scan(&id))
			out = append(out, id)
		}
		return out
	}
	require.Equal(t, []string{"discovery/current", "other"}, ids())

	// After the lease passes to another agent, even the old current epoch is stale.
	_, err = db.Pool.Exec(ctx, `UPDATE leases SET owner = 'agent-2', epoch = 6 WHERE name = 'site:s1:boot'`)
	require.NoError(t, err)
	send("discovery/after", 5, "discovery")
	require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Heartbeat{Heartbeat: &nodev1.Heartbeat{Sequence: 2}}}))
	for {
		m, err := s.recv(t, 5*time.Second)
		require.NoError(t, err)
		if m.GetHeartbeatAck() != nil {
			break
		}
	}
	require.Equal(t, []string{"discovery/current", "other"}, ids())
}

func startGatewayWith(t *testing.T, cfg Config, deps Deps) *Gateway {
	t.Helper()
	g, err := New(cfg, deps)
	require.NoError(t, err)
	require.NoError(t, services.StartAndAwaitRunning(context.Background(), g))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = services.StopAndAwaitTerminated(ctx, g)
	})
	return g
}
