package coord

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/pkg/pgdb"
)

// Group is a membership group: a set of processes that share the 256 shards
// of their leases by rendezvous hashing over the group's live members.
type Group struct {
	// Name is the workers.member_group value.
	Name string
	// RowPrefix prefixes the process id to form the member's workers row id.
	RowPrefix string
	// LeasePrefix prefixes "shard:<n>" to form the group's shard lease names.
	LeasePrefix string
	// Shards is false for the heartbeat-only group of processes that run
	// singletons but no sharded reconciler: they hold no shard leases.
	Shards bool
}

// The groups of DESIGN.md section 5.
var (
	// Controllers runs the node and site reconcilers: rows "<id>", leases "shard:<n>".
	Controllers = Group{Name: "controllers", Shards: true}
	// Scheduler runs the pool-lease placer: rows "scheduler/<id>", leases "scheduler/shard:<n>".
	Scheduler = Group{Name: "scheduler", RowPrefix: "scheduler/", LeasePrefix: "scheduler/", Shards: true}
	// Singletons is where a process with no sharded reconciler heartbeats,
	// so doctor sees it without it ever being named a shard owner.
	Singletons = Group{Name: "singletons", RowPrefix: "singletons/"}
)

// RowID is the workers row id of process id in g.
func (g Group) RowID(processID string) string { return g.RowPrefix + processID }

// ShardLease is the lease name of shard n in g.
func (g Group) ShardLease(n int) string { return ShardLeaseName(g.LeasePrefix, n) }

// ShardOfLease returns the shard number of a lease name of g.
func (g Group) ShardOfLease(name string) (int, bool) {
	var n int
	if _, err := fmt.Sscanf(name, g.LeasePrefix+"shard:%d", &n); err != nil || g.ShardLease(n) != name {
		return 0, false
	}
	return n, n >= 0 && n < NumShards
}

// Timings are the lease and membership durations of DESIGN.md section 10.
type Timings struct {
	// LeaseTTL is the shard and singleton lease TTL (15 s).
	LeaseTTL time.Duration
	// Renew is the membership pass period renewMs (5 s).
	Renew time.Duration
	// LiveWindow is how recent a heartbeat keeps a member live (30 s).
	LiveWindow time.Duration
	// ForgetAfter deletes rows silent this long (10 min).
	ForgetAfter time.Duration
}

// DefaultTimings are DESIGN.md's defaults.
func DefaultTimings() Timings {
	return Timings{LeaseTTL: 15 * time.Second, Renew: 5 * time.Second, LiveWindow: 30 * time.Second, ForgetAfter: 10 * time.Minute}
}

// Validate refuses timings that break DESIGN.md's orderings, naming both values.
func (t Timings) Validate() error {
	var errs []error
	if err := ValidateTTL(t.LeaseTTL); err != nil {
		errs = append(errs, err)
	}
	if t.Renew <= 0 || t.Renew >= t.LeaseTTL/2 {
		errs = append(errs, fmt.Errorf("renew interval %s must be positive and below half the lease TTL %s", t.Renew, t.LeaseTTL))
	}
	if t.LiveWindow <= t.LeaseTTL {
		errs = append(errs, fmt.Errorf("live worker window %s must be longer than the lease TTL %s", t.LiveWindow, t.LeaseTTL))
	}
	if t.ForgetAfter <= t.LiveWindow {
		errs = append(errs, fmt.Errorf("forget-after %s must be longer than the live worker window %s", t.ForgetAfter, t.LiveWindow))
	}
	return errors.Join(errs...)
}

// Tick is the renewal loop's period: max(50 ms, min(1 s, renew/5)).
func (t Timings) Tick() time.Duration {
	return max(50*time.Millisecond, min(time.Second, t.Renew/5))
}

// Member is a live member of a group as one heartbeat saw it.
type Member struct {
	// ID is the member's workers row id.
	ID string
	// Age is how long ago it heartbeated, on the database clock.
	Age time.Duration
}

// HeartbeatInfo is what a member reports about itself on its row.
type HeartbeatInfo struct {
	ProcessID  string
	Hostname   string
	Version    string
	ClockSkew  time.Duration
	NotifyMode string
	LeasesHeld int
	// Liveness: the member's liveness session holds its lock, so survivors
	// may take over as soon as that session ends (liveness.go).
	Liveness bool
}

const heartbeatSQL = `
WITH hb AS (
  INSERT INTO workers (id, member_group, process_id, hostname, version, clock_skew_ms, notify_mode, leases_held, liveness, heartbeat_at)
  VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $11, compute_now())
  ON CONFLICT (id) DO UPDATE SET
    member_group = EXCLUDED.member_group, process_id = EXCLUDED.process_id,
    hostname = EXCLUDED.hostname, version = EXCLUDED.version,
    clock_skew_ms = EXCLUDED.clock_skew_ms, notify_mode = EXCLUDED.notify_mode, liveness = EXCLUDED.liveness,
    leases_held = EXCLUDED.leases_held, heartbeat_at = compute_now()
  RETURNING id, heartbeat_at
), forgotten AS (
  DELETE FROM workers
  WHERE member_group = $2 AND id <> $1 AND heartbeat_at < compute_now() - make_interval(secs => $10::float8)
)
SELECT id, compute_now() - heartbeat_at FROM workers
 WHERE member_group = $2 AND id <> $1 AND heartbeat_at > compute_now() - make_interval(secs => $9::float8)
UNION ALL
SELECT id, interval '0' FROM hb`

// Heartbeat upserts the member's row (heartbeat_at = compute_now()), deletes
// the group's rows silent for ForgetAfter, and returns the live set, all in
// one statement. The live set always includes the caller.
func Heartbeat(ctx context.Context, db pgdb.Querier, g Group, rowID string, info HeartbeatInfo, t Timings) ([]Member, error) {
	mode := info.NotifyMode
	if mode == "" {
		mode = "polling"
	}
	rows, err := db.Query(ctx, heartbeatSQL, rowID, g.Name, info.ProcessID, info.Hostname, info.Version,
		info.ClockSkew.Milliseconds(), mode, info.LeasesHeld, t.LiveWindow.Seconds(), t.ForgetAfter.Seconds(), info.Liveness)
	if err != nil {
		return nil, fmt.Errorf("heartbeat %s in %s: %w", rowID, g.Name, err)
	}
	members, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Member, error) {
		var m Member
		return m, r.Scan(&m.ID, &m.Age)
	})
	if err != nil {
		return nil, fmt.Errorf("heartbeat %s in %s: %w", rowID, g.Name, err)
	}
	sort.Slice(members, func(i, j int) bool { return members[i].ID < members[j].ID })
	return members, nil
}

// Leave deletes the member's row (SIGTERM), so survivors drop it from their
// live set at once.
func Leave(ctx context.Context, db pgdb.Querier, rowIDs ...string) error {
	if _, err := db.Exec(ctx, "DELETE FROM workers WHERE id = ANY($1::text[])", rowIDs); err != nil {
		return fmt.Errorf("leave membership: %w", err)
	}
	return nil
}

// Plan is one member's decision for one pass over a group's shards.
type Plan struct {
	// Mine are the shards rendezvous hashing names this member owner of.
	Mine []int
	// Orphans are shards of silent owners this member tries to take or keeps.
	Orphans []int
	// Release are held shards this member no longer owns.
	Release []int
}

// Want is Mine and Orphans together: the shards to acquire or renew.
func (p Plan) Want() []int { return append(append([]int(nil), p.Mine...), p.Orphans...) }

// PlanShards decides one pass: own what rendezvous hashing names self owner
// of; try every shard whose desired owner is silent (no heartbeat for
// silentAfter, one lease TTL) as an orphan; let go of held shards that are
// neither. An orphan is handed back once its owner heartbeats again, and
// re-planned once the owner leaves the live set.
func PlanShards(self string, members []Member, held map[int]bool, silentAfter time.Duration) Plan {
	ids := make([]string, len(members))
	silent := map[string]bool{}
	for i, m := range members {
		ids[i] = m.ID
		if m.ID != self && m.Age > silentAfter {
			silent[m.ID] = true
		}
	}
	sort.Strings(ids)
	var p Plan
	for s := range NumShards {
		owner := RendezvousOwner(ids, s)
		switch {
		case owner == self:
			p.Mine = append(p.Mine, s)
		case silent[owner]:
			p.Orphans = append(p.Orphans, s)
		case held[s]:
			p.Release = append(p.Release, s)
		}
	}
	return p
}
