package coord

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/pkg/pgnotify"
)

// Liveness sessions let survivors take over a dead member in seconds instead
// of a TTL, without ever overlapping a member that is only paused or cut off.
//
// The member keeps one direct session (never through a transaction pooler)
// holding the session advisory lock (LivenessLockClass, hashtext(owner)),
// and pings it every Ping. It trusts its leases only while its last
// successful ping was sent less than SelfFence ago (on its monotonic clock),
// and after a new session only once a membership pass has confirmed its
// leases again. A survivor that sees the lock of a member flagged live free
// (its backend ended: the process died, or its connection was killed) notes
// the instant, waits SelfFence + Margin, and then, in one transaction that
// first takes the same lock as a transaction lock (so the member cannot come
// back in the middle), releases every lease of the member and deletes its
// membership rows. Ordering (docs/high-availability.md):
//
//	member:   last successful ping sent at P  ->  stops trusting at P + SelfFence
//	survivor: sees the lock free at F >= P    ->  releases at F + SelfFence + Margin > P + SelfFence
//
// A paused member keeps its session and lock, so survivors see it alive and
// the TTL path applies unchanged. A member whose host vanished is noticed by
// the server's TCP keepalive, set short on the liveness session.

// LivenessLockClass is the first key of every liveness advisory lock.
const LivenessLockClass int32 = 0x6c68_6c76 // "lhlv"

// LivenessConfig configures a member's liveness session.
type LivenessConfig struct {
	// URL is a direct database URL (not a transaction pooler); "" turns
	// liveness off: the TTL path alone.
	URL string
	// Ping is the period of the session's ping (500 ms); every other ping
	// also looks for dead peers.
	Ping time.Duration
	// SelfFence is D: with no successful ping sent for this long the
	// member stops trusting every lease (1.5 s).
	SelfFence time.Duration
	// Margin is added to SelfFence before a survivor acts (250 ms).
	Margin time.Duration
}

// DefaultLiveness are the default liveness timings (URL unset).
func DefaultLiveness() LivenessConfig {
	return LivenessConfig{Ping: 500 * time.Millisecond, SelfFence: 1500 * time.Millisecond, Margin: 250 * time.Millisecond}
}

// Validate refuses timings that break the ordering, naming the values: the
// ping must come more often than the self-fence deadline, the margin must
// be positive, and a takeover must be able to happen before the lease TTL.
func (c LivenessConfig) Validate(ttl time.Duration) error {
	if c.URL == "" {
		return nil
	}
	var errs []error
	if c.Ping <= 0 || c.Ping*2 > c.SelfFence {
		errs = append(errs, fmt.Errorf("liveness ping %s must be positive and at most half the self-fence deadline %s", c.Ping, c.SelfFence))
	}
	if c.Margin < 50*time.Millisecond {
		errs = append(errs, fmt.Errorf("liveness margin %s must be at least 50ms", c.Margin))
	}
	if c.SelfFence+c.Margin+2*c.Ping >= ttl {
		errs = append(errs, fmt.Errorf("liveness self-fence %s + margin %s + two pings %s must stay below the lease TTL %s", c.SelfFence, c.Margin, 2*c.Ping, ttl))
	}
	return errors.Join(errs...)
}

// livenessSession is a member's liveness session and its view of its peers.
type livenessSession struct {
	cfg    LivenessConfig
	owner  string
	groups []string
	db     *pgxpool.Pool
	clock  clockwork.Clock
	log    *slog.Logger
	m      *metrics
	onPeer func() // a peer was released, or our session came up: run a pass now

	mu        sync.Mutex
	conn      *pgx.Conn
	held      bool      // the session lock is held on conn
	lastOK    time.Time // send time of the last successful ping
	gen       uint64    // counts sessions that took the lock
	confirmed uint64    // the session generation a pass last confirmed the leases under
	fallback  bool      // the session is down and a pass recorded liveness = false
	lastErr   error
	deadSince map[string]time.Time // peer owner -> when its lock was first seen free
}

// livenessSetupSQL sets the server side of the session's socket so that the
// server notices a vanished host (no FIN, no RST) in about 3 s: keepalives
// (first probe after 1 s idle, then every 1 s, dead after 2 unanswered) bound
// it while the server has nothing unacknowledged to send, and
// tcp_user_timeout (3 s) bounds it when a reply of the server was lost with
// the host, where keepalives do not run and retransmissions alone would take
// up to about 15 minutes (tcp_retries2). Then the backend ends and its
// session lock is free.
const livenessSetupSQL = `
SELECT set_config('tcp_keepalives_idle', '1', false), set_config('tcp_keepalives_interval', '1', false),
       set_config('tcp_keepalives_count', '2', false), set_config('tcp_user_timeout', '3000', false),
       set_config('application_name', left('leasehold-liveness:' || $2, 63), false),
       pg_try_advisory_lock($1, hashtext($2))`

// deadPeersSQL lists members of the groups flagged live whose liveness lock
// nobody holds: their session ended.
const deadPeersSQL = `
SELECT DISTINCT w.process_id FROM workers w
 WHERE w.member_group = ANY($1::text[]) AND w.process_id <> $2 AND w.liveness
   AND NOT EXISTS (SELECT 1 FROM pg_locks l
                    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
                      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                      AND l.classid = $3::int4::oid AND l.objid = hashtext(w.process_id)::oid)`

// releaseDeadSQL releases a dead member's leases on its behalf, publishing
// each name like Release does.
const releaseDeadSQL = `
WITH released AS (
  UPDATE leases SET owner = NULL, expires_at = '-infinity' WHERE owner = $1 RETURNING name
)
SELECT name, pg_notify('` + pgnotify.LeaseReleased + `', name) FROM released`

// noCap is a trust deadline that caps nothing (the TTL path alone).
var noCap = time.Unix(1<<62, 0)

// trustUntil is the last instant the member may trust its leases:
//   - with the session up and its leases confirmed by a pass under it: the
//     send time of the last successful ping plus SelfFence;
//   - with the session down and a pass since then that told the database
//     so (liveness = false, which survivors check before any release): no
//     cap, the TTL path alone;
//   - otherwise zero: nothing is trusted.
func (s *livenessSession) trustUntil() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.fallback:
		return noCap
	case s.confirmed != s.gen || s.lastOK.IsZero():
		return time.Time{}
	default:
		return s.lastOK.Add(s.cfg.SelfFence)
	}
}

// generation is the current session generation, for passed.
func (s *livenessSession) generation() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.gen
}

// passed records a successful membership pass begun under generation gen
// whose heartbeat said liveness = flagged. With the flag set, the leases it
// returned are confirmed under the session; without it (the session was
// down), survivors will not release this member any more, so the TTL path
// alone applies until the session is back.
func (s *livenessSession) passed(gen uint64, flagged bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if gen != s.gen {
		return // a new session came up meanwhile: the next pass confirms it
	}
	if flagged && s.held {
		s.confirmed = gen
	} else if !flagged && !s.held {
		s.fallback = true
	}
}

// up reports whether the session holds its lock, for the heartbeat's
// liveness flag.
func (s *livenessSession) up() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.held
}

func (s *livenessSession) run(ctx context.Context) {
	defer s.close()
	t := s.clock.NewTicker(s.cfg.Ping)
	defer t.Stop()
	for n := 0; ; n++ {
		s.step(ctx, n%2 == 0)
		select {
		case <-ctx.Done():
			return
		case <-t.Chan():
		}
	}
}

func (s *livenessSession) step(ctx context.Context, checkPeers bool) {
	if !s.connected() {
		if err := s.connect(ctx); err != nil {
			s.fail(err)
			return
		}
	}
	sent := s.clock.Now()
	pctx, cancel := context.WithTimeout(ctx, s.cfg.SelfFence-s.cfg.Ping)
	defer cancel()
	var dead []string
	var err error
	if checkPeers {
		var rows pgx.Rows
		rows, err = s.conn.Query(pctx, deadPeersSQL, s.groups, s.owner, LivenessLockClass)
		if err == nil {
			dead, err = pgx.CollectRows(rows, pgx.RowTo[string])
		}
	} else {
		err = s.conn.PgConn().Ping(pctx)
	}
	if err != nil {
		s.fail(err)
		return
	}
	s.mu.Lock()
	s.lastOK, s.lastErr = sent, nil
	s.mu.Unlock()
	s.m.livenessUp.Set(1)
	if checkPeers {
		s.peers(ctx, dead)
	}
}

func (s *livenessSession) connected() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.conn != nil && s.held
}

func (s *livenessSession) connect(ctx context.Context) error {
	s.close()
	cctx, cancel := context.WithTimeout(ctx, s.cfg.SelfFence)
	defer cancel()
	conn, err := pgx.Connect(cctx, s.cfg.URL)
	if err != nil {
		return fmt.Errorf("connect the liveness session: %w", err)
	}
	var a, b, c, d, e string
	var locked bool
	if err := conn.QueryRow(cctx, livenessSetupSQL, LivenessLockClass, s.owner).Scan(&a, &b, &c, &d, &e, &locked); err != nil {
		_ = conn.Close(context.Background())
		return fmt.Errorf("take the liveness lock: %w", err)
	}
	if !locked {
		// An older session of ours that the server has not noticed gone
		// yet, or a survivor releasing us right now: try again later.
		_ = conn.Close(context.Background())
		return errors.New("the liveness lock is held elsewhere (an old session of this process, or a survivor taking over)")
	}
	s.mu.Lock()
	s.conn, s.held = conn, true
	s.gen++
	s.fallback = false
	s.mu.Unlock()
	s.log.Info("liveness session up", "owner", s.owner)
	if s.onPeer != nil {
		s.onPeer() // a pass confirms the leases under this session
	}
	return nil
}

func (s *livenessSession) fail(err error) {
	s.mu.Lock()
	s.lastErr = err
	conn := s.conn
	s.conn, s.held = nil, false
	s.fallback = false // until a pass records liveness = false
	s.mu.Unlock()
	s.m.livenessUp.Set(0)
	if conn != nil {
		_ = conn.Close(context.Background())
		s.log.Warn("liveness session lost: leases are trusted no longer than the self-fence deadline after the last ping", "err", err)
	}
}

func (s *livenessSession) close() {
	s.mu.Lock()
	conn := s.conn
	s.conn, s.held = nil, false
	s.mu.Unlock()
	if conn != nil {
		_ = conn.Close(context.Background())
	}
}

// peers tracks the dead peers and releases those dead for SelfFence+Margin.
func (s *livenessSession) peers(ctx context.Context, dead []string) {
	now := s.clock.Now()
	var due []string
	s.mu.Lock()
	seen := make(map[string]bool, len(dead))
	for _, p := range dead {
		seen[p] = true
		first, ok := s.deadSince[p]
		if !ok {
			s.deadSince[p] = now
			continue
		}
		if now.Sub(first) >= s.cfg.SelfFence+s.cfg.Margin {
			due = append(due, p)
		}
	}
	for p := range s.deadSince {
		if !seen[p] {
			delete(s.deadSince, p) // alive again, or already released
		}
	}
	s.mu.Unlock()
	for _, p := range due {
		released, err := releaseDead(ctx, s.db, p)
		switch {
		case err != nil:
			s.log.Warn("release of a dead member failed; the TTL path still applies", "member", p, "err", err)
		case released < 0:
			s.log.Info("member came back before its takeover", "member", p)
		default:
			s.m.livenessTakeovers.Inc()
			s.log.Info("member's liveness session is gone: released its leases on its behalf", "member", p, "released", released)
			s.mu.Lock()
			delete(s.deadSince, p)
			s.mu.Unlock()
			if s.onPeer != nil {
				s.onPeer()
			}
		}
	}
}

// releaseDead releases every lease of member and deletes its membership
// rows, in one transaction that first takes the member's liveness lock as a
// transaction lock: when the member holds it again, nothing happens and
// released is -1. Open fenced transactions of the member make the release
// wait (the fence's share lock), and its next fence fails.
func releaseDead(ctx context.Context, db *pgxpool.Pool, member string) (released int, err error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var free bool
		if err := tx.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock($1, hashtext($2))`, LivenessLockClass, member).Scan(&free); err != nil {
			return err
		}
		if !free {
			released = -1
			return nil
		}
		// Only a member that still says it keeps a liveness session (a
		// member that lost it for good heartbeats liveness = false).
		var flagged *bool
		if err := tx.QueryRow(ctx, `SELECT bool_or(liveness) FROM (SELECT liveness FROM workers WHERE process_id = $1 FOR UPDATE) w`, member).Scan(&flagged); err != nil {
			return err
		}
		if flagged == nil || !*flagged {
			released = -1
			return nil
		}
		rows, err := tx.Query(ctx, releaseDeadSQL, member)
		if err != nil {
			return err
		}
		names, err := collectReleased(rows)
		if err != nil {
			return err
		}
		released = len(names)
		_, err = tx.Exec(ctx, `DELETE FROM workers WHERE process_id = $1`, member)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("release dead member %s: %w", member, err)
	}
	return released, nil
}

// LivenessDetail is the liveness section of /healthz/detail.
type LivenessDetail struct {
	Mode        string   `json:"mode"` // "session" or "ttl-only"
	SessionUp   bool     `json:"session_up"`
	LastPingAgo string   `json:"last_ping_ago,omitempty"`
	Trusted     bool     `json:"leases_trusted"`
	DeadPeers   []string `json:"dead_peers,omitempty"`
	Error       string   `json:"error,omitempty"`
}

func (s *livenessSession) detail() LivenessDetail {
	if s == nil {
		return LivenessDetail{Mode: "ttl-only"}
	}
	until := s.trustUntil()
	s.mu.Lock()
	defer s.mu.Unlock()
	d := LivenessDetail{Mode: "session", SessionUp: s.held, Trusted: s.clock.Now().Before(until)}
	if s.fallback {
		d.Mode = "ttl-only (session down)"
	}
	if !s.lastOK.IsZero() {
		d.LastPingAgo = s.clock.Since(s.lastOK).Round(time.Millisecond).String()
	}
	for p := range s.deadSince {
		d.DeadPeers = append(d.DeadPeers, p)
	}
	if s.lastErr != nil {
		d.Error = s.lastErr.Error()
	}
	return d
}
