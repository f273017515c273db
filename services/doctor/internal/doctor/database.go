package doctor

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/leasehold/leasehold/migrations"
)

func checkVersion(ctx context.Context, d *Doctor) (Finding, error) {
	var num int
	var version string
	err := d.read(ctx, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, "SELECT current_setting('server_version_num')::int, version()").Scan(&num, &version)
	})
	if err != nil {
		return Finding{}, err
	}
	f := classifyVersion(num)
	f.add("server_version_num", "%d", num)
	f.add("version", "%s", version)
	return f, nil
}

// classifyVersion judges server_version_num against the supported minimum.
func classifyVersion(num int) Finding {
	major := num / 10000
	if num < minSupportedServerNum {
		return warn(fmt.Sprintf("PostgreSQL %d is older than %s, the oldest leasehold supports", major, minSupportedServerName),
			"upgrade PostgreSQL to "+minSupportedServerName+" or later (pg_upgrade, or a logical replica and a switchover)")
	}
	return ok(fmt.Sprintf("PostgreSQL %d", major))
}

func checkMigrations(ctx context.Context, d *Doctor) (Finding, error) {
	// A database/sql handle over the pool's connection settings, so the
	// check goes through the same URL (and pooler) with the same role.
	db := stdlib.OpenDB(*d.db.Config().ConnConfig.Copy())
	defer db.Close()
	ctx, cancel := context.WithTimeout(ctx, d.cfg.CheckTimeout)
	defer cancel()
	st, err := migrations.Check(ctx, db)
	if err != nil && !errors.Is(err, migrations.ErrDatabaseNewer) {
		return Finding{}, err
	}
	var f Finding
	switch {
	case errors.Is(err, migrations.ErrDatabaseNewer):
		f = critical(fmt.Sprintf("the database schema (version %d) is newer than this binary (version %d)", st.Current, st.Target),
			"a newer release migrated this database: upgrade the binaries (this doctor included); services refuse to start against a newer schema")
	case st.Pending > 0:
		f = warn(fmt.Sprintf("%s pending: the database is at version %d, the binary at %d", plural(st.Pending, "migration", "migrations"), st.Current, st.Target),
			"apply them with `make migrate` or by starting one process with --migrate (on a direct URL, not through a transaction pooler)")
	default:
		f = ok(fmt.Sprintf("schema at version %d, as this binary expects", st.Current))
	}
	f.add("current", "%d", st.Current)
	f.add("target", "%d", st.Target)
	f.add("pending", "%d", st.Pending)
	return f, nil
}

// poolerProbe decides whether the pool's URL goes through a transaction
// pooler: two client connections, A and B. A runs a statement, B opens a
// transaction, A runs another. Directly or through a session pooler a client
// connection keeps its backend, so A's pid never changes and B's differs.
// A transaction pooler hands a server connection to whoever needs it next:
// B's transaction gets the backend A just released, or A moves to another.
type poolerProbe struct {
	pidA1, pidB, pidA2 int32
	serverPort         *int32
	urlPort            uint16
	unixSocket         bool
}

func (p poolerProbe) transaction() bool { return p.pidB == p.pidA1 || p.pidA2 != p.pidA1 }

// proxied reports a listening port different from the URL's: something (a
// pooler, a proxy) sits between this client and the server.
func (p poolerProbe) proxied() bool {
	return !p.unixSocket && p.serverPort != nil && int(*p.serverPort) != int(p.urlPort)
}

func (d *Doctor) probePooler(ctx context.Context) (poolerProbe, error) {
	cc := d.db.Config().ConnConfig
	p := poolerProbe{urlPort: cc.Port, unixSocket: strings.HasPrefix(cc.Host, "/")}
	a, err := d.db.Acquire(ctx)
	if err != nil {
		return p, err
	}
	defer a.Release()
	b, err := d.db.Acquire(ctx)
	if err != nil {
		return p, err
	}
	defer b.Release()
	if err := a.QueryRow(ctx, "SELECT pg_backend_pid(), inet_server_port()").Scan(&p.pidA1, &p.serverPort); err != nil {
		return p, err
	}
	tx, err := b.Begin(ctx)
	if err != nil {
		return p, err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if err := tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&p.pidB); err != nil {
		return p, err
	}
	if err := a.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&p.pidA2); err != nil {
		return p, err
	}
	return p, tx.Rollback(ctx)
}

const notifyModesSQL = `
SELECT notify_mode, count(*), string_agg(id, ', ' ORDER BY id)
  FROM workers WHERE heartbeat_at > compute_now() - make_interval(secs => $1::float8)
 GROUP BY notify_mode ORDER BY notify_mode`

func checkPooling(ctx context.Context, d *Doctor) (Finding, error) {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.CheckTimeout)
	defer cancel()
	probe, err := d.probePooler(ctx)
	if err != nil {
		return Finding{}, fmt.Errorf("pooler probe: %w", err)
	}
	modes := map[string]int{}
	ids := map[string]string{}
	err = d.read(ctx, func(tx pgx.Tx) error {
		r, err := tx.Query(ctx, notifyModesSQL, d.cfg.LiveWindow.Seconds())
		if err != nil {
			return err
		}
		var mode, list string
		var n int
		_, err = pgx.ForEachRow(r, []any{&mode, &n, &list}, func() error { modes[mode] = n; ids[mode] = list; return nil })
		return err
	})
	if err != nil {
		return Finding{}, err
	}
	pooled := probe.transaction()
	where := "no transaction pooler between doctor and the server"
	if pooled {
		where = "transaction pooler detected"
	}
	live := modes["listen"] + modes["polling"]
	var f Finding
	switch {
	case modes["polling"] > 0:
		hint := "give the workers --listen-database-url with a direct (session) URL so lease releases wake them at once; " +
			"by polling a planned handover waits up to one renew period (5 s) and a crash still takes TTL + one tick"
		if !pooled {
			hint += "; this URL is not a transaction pooler, so LISTEN works on it (drop --pooler if the workers set it)"
		}
		f = warn(fmt.Sprintf("%s; polling fallback in force: %d of %d live workers poll for lease releases (no LISTEN)",
			where, modes["polling"], live), hint)
	case live == 0:
		f = ok(where + "; no live workers report a notify mode")
	default:
		f = ok(fmt.Sprintf("%s; LISTEN available: all %d live workers listen for lease releases", where, live))
	}
	if pooled {
		f.add("pooler", "transaction (backend changed between transactions of one client connection: pids %d, %d, %d)", probe.pidA1, probe.pidB, probe.pidA2)
	} else {
		f.add("pooler", "none or session (client connection kept backend pid %d)", probe.pidA1)
	}
	switch {
	case probe.unixSocket:
		f.add("connection", "unix socket %s", d.db.Config().ConnConfig.Host)
	case probe.serverPort == nil:
		f.add("connection", "port %d", probe.urlPort)
	case probe.proxied():
		f.add("connection", "URL port %d, server port %d: a pooler or proxy is in between", probe.urlPort, *probe.serverPort)
	default:
		f.add("connection", "direct, port %d", probe.urlPort)
	}
	for _, m := range []string{"listen", "polling"} {
		if modes[m] > 0 {
			f.add("workers_"+m, "%d: %s", modes[m], ids[m])
		}
	}
	return f, nil
}

const replicationSQL = `
SELECT coalesce(application_name, ''), coalesce(client_addr::text, 'local'), state, sync_state,
       coalesce(replay_lag, interval '0')
  FROM pg_stat_replication ORDER BY application_name`

func checkReplication(ctx context.Context, d *Doctor) (Finding, error) {
	type standby struct {
		name, addr       string
		state, syncState *string
		lag              time.Duration
	}
	var rows []standby
	var recovery bool
	var syncNames, syncCommit string
	err := d.read(ctx, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, "SELECT pg_is_in_recovery(), current_setting('synchronous_standby_names'), current_setting('synchronous_commit')").
			Scan(&recovery, &syncNames, &syncCommit); err != nil {
			return err
		}
		r, err := tx.Query(ctx, replicationSQL)
		if err != nil {
			return err
		}
		rows, err = pgx.CollectRows(r, func(r pgx.CollectableRow) (standby, error) {
			var s standby
			return s, r.Scan(&s.name, &s.addr, &s.state, &s.syncState, &s.lag)
		})
		return err
	})
	if err != nil {
		return Finding{}, err
	}
	if recovery {
		f := warn("doctor is connected to a standby (in recovery): findings may lag the primary, and replication is judged on the primary",
			"point --database-url at the primary (or the pooler in front of it)")
		f.add("in_recovery", "true")
		return f, nil
	}
	var syncN, asyncN int
	for _, s := range rows {
		if s.syncState == nil {
			return unchecked(fmt.Sprintf("%s replicate from this server but their state is hidden from this role", plural(len(rows), "client", "clients")),
				"grant the doctor's role pg_monitor (or pg_read_all_stats)"), nil
		}
		switch *s.syncState {
		case "sync", "quorum":
			syncN++
		default:
			asyncN++
		}
	}
	var f Finding
	switch {
	case len(rows) == 0:
		f = ok("no standby replicates from this server (note: losing the primary means restoring a backup)")
	case syncN > 0 && (syncCommit == "off" || syncCommit == "local"):
		f = warn(fmt.Sprintf("%s synchronous, but synchronous_commit = %s: a failover can lose recent commits", plural(syncN, "standby is", "standbys are"), syncCommit),
			"set synchronous_commit = on (or remote_apply) for leasehold's role so commits wait for the standby")
	case syncN > 0:
		f = ok(fmt.Sprintf("%s synchronous, %d asynchronous", plural(syncN, "standby", "standbys"), asyncN))
	default:
		f = warn(fmt.Sprintf("asynchronous standby only (%d): a failover can lose recent commits", asyncN),
			"set synchronous_standby_names (e.g. 'ANY 1 (standby_a, standby_b)') with synchronous_commit = on, or accept that a failover "+
				"rolls the fleet back by the replication lag, like a small point-in-time restore")
	}
	f.add("synchronous_standby_names", "%q", syncNames)
	f.add("synchronous_commit", "%s", syncCommit)
	capped(&f, "standby", rows, func(s standby) string {
		return fmt.Sprintf("%s from %s %s %s replay lag %s", orDash(s.name), s.addr, deref(s.state), deref(s.syncState), dur(s.lag))
	})
	return f, nil
}

func deref(s *string) string {
	if s == nil {
		return "?"
	}
	return *s
}

const connectionsSQL = `
SELECT current_setting('max_connections')::int,
       current_setting('superuser_reserved_connections')::int,
       coalesce(nullif(current_setting('reserved_connections', true), ''), '0')::int,
       (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')`

const observedProcessesSQL = `
SELECT
  (SELECT count(DISTINCT coalesce(nullif(process_id, ''), id)) FROM workers
    WHERE member_group <> 'scheduler' AND heartbeat_at > compute_now() - make_interval(secs => $1::float8)),
  (SELECT count(DISTINCT coalesce(nullif(process_id, ''), id)) FROM workers
    WHERE member_group = 'scheduler' AND heartbeat_at > compute_now() - make_interval(secs => $1::float8)),
  (SELECT count(*) FROM leases WHERE name LIKE 'gateway:%' AND expires_at > compute_now())`

func checkConnections(ctx context.Context, d *Doctor) (Finding, error) {
	var maxConns, suReserved, reserved, used, workers, schedulers, gateways int
	err := d.read(ctx, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, connectionsSQL).Scan(&maxConns, &suReserved, &reserved, &used); err != nil {
			return err
		}
		return tx.QueryRow(ctx, observedProcessesSQL, d.cfg.LiveWindow.Seconds()).Scan(&workers, &schedulers, &gateways)
	})
	if err != nil {
		return Finding{}, err
	}
	c := d.cfg
	pick := func(expect, seen int) (int, string) {
		if expect >= 0 {
			return expect, "configured"
		}
		return seen, "live"
	}
	w, wSrc := pick(c.ExpectWorkers, workers)
	s, sSrc := pick(c.ExpectSchedulers, schedulers)
	g, gSrc := pick(c.ExpectGateways, gateways)
	// Every process has a pool of ExpectPoolSize; workers, schedulers and
	// gateways one more session connection for LISTEN; plus this doctor.
	need := (w+s+g+c.ExpectAPIs+c.ExpectSiteAgents)*c.ExpectPoolSize + w + s + g + 1
	avail := maxConns - suReserved - reserved
	var f Finding
	switch {
	case need > avail:
		f = critical(fmt.Sprintf("the processes may open %d connections but max_connections leaves %d for them", need, avail),
			"raise max_connections (a restart), lower --db-max-conns, or put PgBouncer in transaction mode in front of the pools "+
				"(LISTEN keeps a direct URL); set this doctor's --expect-* flags to the deployment's process counts")
	case need*10 > avail*8:
		f = warn(fmt.Sprintf("the processes may open %d of the %d connections max_connections leaves: under 20%% headroom", need, avail),
			"raise max_connections or lower --db-max-conns before adding processes")
	case used*10 > avail*9:
		f = warn(fmt.Sprintf("%d of %d connections in use now: under 10%% headroom", used, avail),
			"find the clients holding connections (pg_stat_activity by application_name) or raise max_connections")
	default:
		f = ok(fmt.Sprintf("the processes may open %d of %d available connections (%d in use now)", need, avail, used))
	}
	f.add("max_connections", "%d (reserved: %d superuser, %d other)", maxConns, suReserved, reserved)
	f.add("in_use", "%d client backends", used)
	f.add("processes", "workers %d (%s), schedulers %d (%s), gateways %d (%s), api %d, site agents %d, pool size %d",
		w, wSrc, s, sSrc, g, gSrc, c.ExpectAPIs, c.ExpectSiteAgents, c.ExpectPoolSize)
	f.add("need", "%d = processes × pool size + one LISTEN connection per worker, scheduler and gateway + this doctor", need)
	if probe, err := d.probePooler(ctx); err == nil && (probe.transaction() || probe.proxied()) {
		f.add("note", "this URL goes through a pooler: processes behind it share its server connections (its pool size bounds them), so the estimate is an upper bound")
	}
	return f, nil
}
