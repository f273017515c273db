package siteboot

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type fixture struct {
	db  *pgxpool.Pool
	cfg Config
}

func setup(t *testing.T) fixture {
	t.Helper()
	db := pgtest.New(t)
	f := fixture{db: db, cfg: DefaultConfig()}
	f.exec(t, `INSERT INTO leases (name, owner, epoch, expires_at) VALUES ('gateway:gw', 'gw', 1, compute_now() + interval '1 hour')`)
	return f
}

func (f fixture) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	_, err := f.db.Exec(context.Background(), sql, args...)
	require.NoError(t, err)
}

// agent creates a site agent at site, connected through gateway gw when connected.
func (f fixture) agent(t *testing.T, id, site string, connected bool) {
	t.Helper()
	f.exec(t, `INSERT INTO nodes (id, kind, site_id, state, spec) VALUES ($1, 'site_agent', $2, 'connected', '{"labels":{"rack":"r1"},"attributes":{"keep":"me"}}')`, id, site)
	f.exec(t, `INSERT INTO node_sessions (node_id, gateway_id, session_epoch, state, session_expires_at)
		VALUES ($1, 'gw', 1, 'connected', compute_now() + interval '40 seconds')`, id)
	if !connected {
		f.disconnect(t, id)
	}
}

func (f fixture) disconnect(t *testing.T, id string) {
	t.Helper()
	f.exec(t, `UPDATE node_sessions SET state = 'disconnected' WHERE node_id = $1`, id)
	f.exec(t, `UPDATE nodes SET state = 'disconnected' WHERE id = $1`, id)
}

func (f fixture) reconnect(t *testing.T, id string) {
	t.Helper()
	f.exec(t, `UPDATE node_sessions SET state = 'connected', session_epoch = session_epoch + 1 WHERE node_id = $1`, id)
	f.exec(t, `UPDATE nodes SET state = 'connected' WHERE id = $1`, id)
}

func (f fixture) pass(t *testing.T, site string) Outcome {
	t.Helper()
	var out Outcome
	require.NoError(t, pgdb.InTx(context.Background(), f.db, func(tx pgx.Tx) error {
		var err error
		out, err = Reconcile(context.Background(), tx, site, f.cfg)
		return err
	}))
	return out
}

type lease struct {
	owner     string
	epoch     int64
	remaining time.Duration
}

func (f fixture) lease(t *testing.T, site string) lease {
	t.Helper()
	var (
		l  lease
		ms float64
	)
	require.NoError(t, f.db.QueryRow(context.Background(), `
SELECT owner, epoch, extract(epoch FROM expires_at - compute_now()) * 1000 FROM leases WHERE name = $1`, LeaseName(site)).Scan(&l.owner, &l.epoch, &ms))
	l.remaining = time.Duration(ms) * time.Millisecond
	return l
}

// expire moves the lease's expiry ago into the past (as if that much time
// had passed since it ran out).
func (f fixture) expire(t *testing.T, site string, ago time.Duration) {
	t.Helper()
	f.exec(t, `UPDATE leases SET expires_at = compute_now() - make_interval(secs => $2::float8) WHERE name = $1`, LeaseName(site), ago.Seconds())
}

type spec struct {
	Labels   map[string]string `json:"labels"`
	SiteBoot struct {
		Active bool   `json:"active"`
		Epoch  string `json:"epoch"`
		SiteID string `json:"site_id"`
	} `json:"site_boot"`
	Attributes map[string]string `json:"attributes"`
	version    int64
	// typed is the spec as the gateway reads it (protojson into NodeSpec).
	typed *nodev1.NodeSpec
}

func (f fixture) spec(t *testing.T, id string) spec {
	t.Helper()
	var (
		raw []byte
		s   spec
	)
	require.NoError(t, f.db.QueryRow(context.Background(), "SELECT spec, spec_version FROM nodes WHERE id = $1", id).Scan(&raw, &s.version))
	require.NoError(t, json.Unmarshal(raw, &s))
	s.typed = &nodev1.NodeSpec{}
	require.NoError(t, protojson.UnmarshalOptions{DiscardUnknown: true}.Unmarshal(raw, s.typed))
	return s
}

func TestFirstConnectedAgentByIDTakesTheLeaseAndOnlyItIsActive(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.agent(t, "agent-b", "s1", true)
	f.agent(t, "agent-a", "s1", true)
	f.agent(t, "agent-0", "s1", false) // first by id, but not connected
	f.agent(t, "other", "s2", true)

	out := f.pass(t, "s1")
	require.Equal(t, Outcome{Action: "promoted", Holder: "agent-a", Epoch: 1}, out)
	l := f.lease(t, "s1")
	require.Equal(t, "agent-a", l.owner)
	require.InDelta(t, f.cfg.LeaseTTL.Seconds(), l.remaining.Seconds(), 1)

	a := f.spec(t, "agent-a")
	require.True(t, a.SiteBoot.Active)
	require.Equal(t, "1", a.SiteBoot.Epoch)
	require.Equal(t, "s1", a.SiteBoot.SiteID)
	require.NotEmpty(t, a.Attributes[AttrGrantedAt])
	require.Equal(t, "15000", a.Attributes[AttrLeaseTTLMs])
	require.Equal(t, "15000", a.Attributes[AttrPromoteMs])
	require.Equal(t, "me", a.Attributes["keep"], "the rest of the spec is left alone")
	sb := a.typed.GetSiteBoot()
	require.Equal(t, f.cfg.LeaseTTL, sb.GetLeaseTtl().AsDuration())
	require.Equal(t, f.cfg.PromoteAfter, sb.GetPromoteAfter().AsDuration())
	require.NotNil(t, sb.GetGrantedAt(), "the holder's grant carries granted_at")
	validFor := sb.GetExpiresAt().AsTime().Sub(sb.GetGrantedAt().AsTime())
	require.Positive(t, validFor, "expires_at is after granted_at")
	require.LessOrEqual(t, validFor, f.cfg.LeaseTTL, "expires_at is at most granted_at + TTL")
	require.Equal(t, "r1", a.Labels["rack"])
	for _, id := range []string{"agent-b", "agent-0"} {
		s := f.spec(t, id)
		require.False(t, s.SiteBoot.Active, id)
		require.Equal(t, "1", s.SiteBoot.Epoch)
		require.Empty(t, s.Attributes[AttrGrantedAt])
		require.Equal(t, "agent-a", s.Attributes[AttrHolder])
		require.Nil(t, s.typed.GetSiteBoot().GetGrantedAt(), "a standby gets no granted_at")
		require.Equal(t, f.cfg.LeaseTTL, s.typed.GetSiteBoot().GetLeaseTtl().AsDuration())
	}
	require.Empty(t, f.spec(t, "other").SiteBoot.SiteID, "another site is untouched")

	var due float64
	require.NoError(t, f.db.QueryRow(context.Background(),
		"SELECT extract(epoch FROM due_at - compute_now()) FROM work_queue WHERE reconciler = 'sites' AND key = 's1'").Scan(&due))
	require.InDelta(t, f.cfg.RenewEvery.Seconds(), due, 0.5, "the site runs again within the renewal interval")
}

func TestRenewalKeepsEpochAndRefreshesTheGrant(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.agent(t, "a1", "s1", true)
	f.agent(t, "a2", "s1", true)
	f.pass(t, "s1")
	first := f.spec(t, "a1")
	standby := f.spec(t, "a2")
	f.exec(t, `UPDATE leases SET expires_at = compute_now() + interval '2 seconds' WHERE name = 'site:s1:boot'`)
	// The renewal's grant is stamped with compute_now(): wait until the
	// database clock has moved past the first grant, so a fresh one differs.
	require.Eventually(t, func() bool {
		var later bool
		err := f.db.QueryRow(context.Background(), `SELECT compute_now() > $1`, first.typed.GetSiteBoot().GetGrantedAt().AsTime()).Scan(&later)
		return err == nil && later
	}, 10*time.Second, time.Millisecond, "the database clock moved past the first grant")

	out := f.pass(t, "s1")
	require.Equal(t, Outcome{Action: "renewed", Holder: "a1", Epoch: 1}, out)
	require.Greater(t, f.lease(t, "s1").remaining, 14*time.Second)
	second := f.spec(t, "a1")
	require.True(t, second.SiteBoot.Active)
	require.Greater(t, second.Attributes[AttrGrantedAt], first.Attributes[AttrGrantedAt], "a fresh grant")
	require.True(t, second.typed.GetSiteBoot().GetGrantedAt().AsTime().After(first.typed.GetSiteBoot().GetGrantedAt().AsTime()), "a fresh typed grant")
	require.Greater(t, second.version, first.version, "spec_version rose, so the gateway pushes it")
	require.Equal(t, standby.version, f.spec(t, "a2").version, "an unchanged standby spec is not rewritten")
}

func TestDisconnectedHolderKeepsTheLeaseUntilExpiryThenTheStandbyIsPromoted(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.agent(t, "a1", "s1", true)
	f.agent(t, "a2", "s1", true)
	f.pass(t, "s1")
	before := f.lease(t, "s1")
	grant := f.spec(t, "a1")

	f.disconnect(t, "a1")
	out := f.pass(t, "s1")
	require.Equal(t, Outcome{Action: "unrenewed", Holder: "a1", Epoch: 1}, out)
	after := f.lease(t, "s1")
	require.Equal(t, "a1", after.owner, "a disconnected holder keeps the lease")
	require.LessOrEqual(t, after.remaining, before.remaining, "but it is not renewed")
	require.Equal(t, grant.version, f.spec(t, "a1").version, "its last grant is left to age out")
	require.False(t, f.spec(t, "a2").SiteBoot.Active, "no standby is promoted while the lease is live")

	f.expire(t, "s1", time.Millisecond)
	out = f.pass(t, "s1")
	require.Equal(t, Outcome{Action: "promoted", Holder: "a2", Epoch: 2}, out)
	require.True(t, f.spec(t, "a2").SiteBoot.Active)
	require.Equal(t, "2", f.spec(t, "a2").SiteBoot.Epoch)
	old := f.spec(t, "a1")
	require.False(t, old.SiteBoot.Active, "the old holder is told it is a standby at the new epoch")
	require.Equal(t, "2", old.SiteBoot.Epoch)

	// The old holder comes back: it stays a standby.
	f.reconnect(t, "a1")
	out = f.pass(t, "s1")
	require.Equal(t, Outcome{Action: "renewed", Holder: "a2", Epoch: 2}, out)
}

func TestPromotionWaitsForPromoteAfter(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.cfg.PromoteAfter = f.cfg.LeaseTTL + 10*time.Second
	f.agent(t, "a1", "s1", true)
	f.agent(t, "a2", "s1", true)
	f.pass(t, "s1")
	f.disconnect(t, "a1")
	f.expire(t, "s1", time.Second)
	out := f.pass(t, "s1")
	require.Equal(t, "waiting", out.Action, "expired, but promote-after has not passed since the last renewal")
	require.Equal(t, "a1", f.lease(t, "s1").owner)
	require.False(t, f.spec(t, "a2").SiteBoot.Active)

	f.expire(t, "s1", 10*time.Second+50*time.Millisecond)
	out = f.pass(t, "s1")
	require.Equal(t, Outcome{Action: "promoted", Holder: "a2", Epoch: 2}, out)
}

func TestExpiredHolderThatReconnectedRetakesAtTheSameEpoch(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.agent(t, "a1", "s1", true)
	f.agent(t, "a2", "s1", true)
	f.pass(t, "s1")
	f.expire(t, "s1", 3*time.Second) // e.g. the site's worker died for longer than the TTL
	out := f.pass(t, "s1")
	require.Equal(t, Outcome{Action: "retaken", Holder: "a1", Epoch: 1}, out)
	require.True(t, f.spec(t, "a1").SiteBoot.Active)
}

func TestDeadGatewayCountsAsDisconnected(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.agent(t, "a1", "s1", true)
	f.pass(t, "s1")
	f.exec(t, `UPDATE leases SET expires_at = compute_now() - interval '1 second' WHERE name = 'gateway:gw'`)
	require.Equal(t, "unrenewed", f.pass(t, "s1").Action)
}

func TestNoConnectedAgentLeavesTheSiteIdle(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.agent(t, "a1", "s1", false)
	out := f.pass(t, "s1")
	require.Equal(t, "idle", out.Action)
	require.Equal(t, "", out.Holder)
	require.Equal(t, Outcome{Action: "idle"}, f.pass(t, "nowhere"))
}

func TestScanEnqueuesEverySiteWithAgents(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.agent(t, "a1", "s1", true)
	f.agent(t, "a2", "s1", false)
	f.agent(t, "b1", "s2", true)
	f.exec(t, `INSERT INTO nodes (id, kind, site_id) VALUES ('n1', 'node', 's3')`)
	f.exec(t, `INSERT INTO nodes (id, kind, site_id) VALUES ('bad', 'site_agent', 'has space')`)
	var n int
	require.NoError(t, pgdb.InTx(context.Background(), f.db, func(tx pgx.Tx) error {
		var err error
		n, err = Scan(context.Background(), tx, f.cfg)
		return err
	}))
	require.Equal(t, 2, n)
	rows, err := f.db.Query(context.Background(), "SELECT key FROM work_queue WHERE reconciler = 'sites' ORDER BY key")
	require.NoError(t, err)
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"s1", "s2"}, keys)
}

func TestConfigRefusesBrokenOrderings(t *testing.T) {
	t.Parallel()
	require.NoError(t, DefaultConfig().Validate())
	c := DefaultConfig()
	c.PromoteAfter = 10 * time.Second
	require.ErrorContains(t, c.Validate(), "--sites.promote-after 10s must be >= --sites.boot-lease-ttl 15s")
	c = DefaultConfig()
	c.RenewEvery = 6 * time.Second
	require.ErrorContains(t, c.Validate(), "--sites.renew-interval 6s must be >= 10ms and <= a third of --sites.boot-lease-ttl 15s")
}
