package doctor

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

const gatewayLeasesSQL = `
SELECT substr(name, length('gateway:') + 1), coalesce(owner, ''), epoch, expires_at > compute_now(),
       CASE WHEN isfinite(expires_at) THEN expires_at - compute_now() END
  FROM leases WHERE name LIKE 'gateway:%'
 ORDER BY name`

type gatewayRow struct {
	id    string
	lease leaseRow
}

func readGateways(ctx context.Context, tx pgx.Tx) ([]gatewayRow, error) {
	r, err := tx.Query(ctx, gatewayLeasesSQL)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(r, func(r pgx.CollectableRow) (gatewayRow, error) {
		var g gatewayRow
		return g, r.Scan(&g.id, &g.lease.owner, &g.lease.epoch, &g.lease.live, &g.lease.left)
	})
}

func checkGatewaysNone(ctx context.Context, d *Doctor) (Finding, error) {
	var gws []gatewayRow
	var nodes int
	err := d.read(ctx, func(tx pgx.Tx) error {
		var err error
		if gws, err = readGateways(ctx, tx); err != nil {
			return err
		}
		return tx.QueryRow(ctx, "SELECT count(*) FROM nodes WHERE state <> 'revoked'").Scan(&nodes)
	})
	if err != nil {
		return Finding{}, err
	}
	var live, dead []gatewayRow
	for _, g := range gws {
		if g.lease.live {
			live = append(live, g)
		} else if g.lease.left != nil {
			dead = append(dead, g)
		}
	}
	// The most recently expired first: the last gateway seen alive.
	sort.Slice(dead, func(i, j int) bool { return *dead[i].lease.left > *dead[j].lease.left })
	var f Finding
	switch {
	case len(live) > 0:
		f = ok(fmt.Sprintf("%s a live lease", plural(len(live), "gateway holds", "gateways hold")))
	case nodes > 0:
		f = critical(fmt.Sprintf("no gateway holds a live lease: none of %s can connect", plural(nodes, "registered node", "registered nodes")),
			"start leasehold-gateway (three or more per region behind an L4 balancer); a gateway that exits at once logs why (database, --listen-addr, TLS files)")
	default:
		f = warn("no gateway is running (no nodes registered yet)",
			"start leasehold-gateway before registering nodes")
	}
	f.add("registered_nodes", "%d", nodes)
	capped(&f, "gateway", live, func(g gatewayRow) string { return fmt.Sprintf("%s %s", g.id, g.lease) })
	if len(live) == 0 {
		capped(&f, "expired_gateway", dead, func(g gatewayRow) string { return fmt.Sprintf("%s %s", g.id, g.lease) })
	}
	return f, nil
}

const sessionsPerGatewaySQL = `
SELECT gateway_id, count(*) FROM node_sessions WHERE state = 'connected' GROUP BY gateway_id`

func checkHeadroom(ctx context.Context, d *Doctor) (Finding, error) {
	var gws []gatewayRow
	sessions := map[string]int{}
	err := d.read(ctx, func(tx pgx.Tx) error {
		var err error
		if gws, err = readGateways(ctx, tx); err != nil {
			return err
		}
		r, err := tx.Query(ctx, sessionsPerGatewaySQL)
		if err != nil {
			return err
		}
		var id string
		var n int
		_, err = pgx.ForEachRow(r, []any{&id, &n}, func() error { sessions[id] = n; return nil })
		return err
	})
	if err != nil {
		return Finding{}, err
	}
	type gw struct {
		id       string
		sessions int
	}
	regions := map[string][]gw{}
	for _, g := range gws {
		if g.lease.live {
			reg := d.cfg.Regions.Of(g.id)
			regions[reg] = append(regions[reg], gw{g.id, sessions[g.id]})
		}
	}
	if len(regions) == 0 {
		f := ok("no live gateways to size (see gateways.none)")
		f.add("max_streams", "%d", d.cfg.MaxStreams)
		return f, nil
	}
	names := make([]string, 0, len(regions))
	for r := range regions {
		names = append(names, r)
	}
	sort.Strings(names)
	maxS := d.cfg.MaxStreams
	worst := SeverityOK
	var problems, fine []string
	var ev []Evidence
	for _, reg := range names {
		list := regions[reg]
		sort.Slice(list, func(i, j int) bool {
			if list[i].sessions != list[j].sessions {
				return list[i].sessions > list[j].sessions
			}
			return list[i].id < list[j].id
		})
		total := 0
		for _, g := range list {
			total += g.sessions
		}
		n := len(list)
		busiest := list[0]
		survivorCap := (n - 1) * maxS
		var full []string
		for _, g := range list {
			if g.sessions >= maxS {
				full = append(full, g.id)
			}
		}
		sev := SeverityOK
		switch {
		case len(full) > 0:
			sev = SeverityCritical
			problems = append(problems, fmt.Sprintf("region %s: %s at --max-streams %d (%s): new nodes are refused now",
				reg, plural(len(full), "gateway", "gateways"), maxS, strings.Join(full, ", ")))
		case total > survivorCap:
			sev = SeverityWarn
			if n == 1 {
				problems = append(problems, fmt.Sprintf("region %s: one gateway (%s, %d sessions): losing it disconnects every node", reg, busiest.id, busiest.sessions))
			} else {
				problems = append(problems, fmt.Sprintf("region %s: losing %s (%d sessions) leaves %d sessions for %s of %d streams (%d short)",
					reg, busiest.id, busiest.sessions, total, plural(n-1, "gateway", "gateways"), maxS, total-survivorCap))
			}
		case n == 1:
			// Only reached with no sessions: a lone gateway survives
			// nothing, it just has nothing to lose yet.
			fine = append(fine, fmt.Sprintf("region %s: one gateway (%s) and no sessions: nothing to move now, but losing it leaves the region no gateway", reg, busiest.id))
		default:
			fine = append(fine, fmt.Sprintf("region %s: the other %s hold all %d sessions if %s is lost", reg, plural(n-1, "gateway", "gateways"), total, busiest.id))
		}
		if sev.rank() > worst.rank() {
			worst = sev
		}
		ev = append(ev, Evidence{"region", fmt.Sprintf("%s: %d gateways, %d sessions, N-1 capacity %d (%d × %d)", reg, n, total, survivorCap, n-1, maxS)})
		for i, g := range list {
			if i == maxEvidenceRows {
				ev = append(ev, Evidence{"gateway", fmt.Sprintf("… and %d more", len(list)-maxEvidenceRows)})
				break
			}
			ev = append(ev, Evidence{"gateway", fmt.Sprintf("%s (%s): %d/%d sessions (%d%%)", g.id, reg, g.sessions, maxS, g.sessions*100/maxS)})
		}
	}
	ev = append(ev, Evidence{"max_streams", fmt.Sprint(maxS)})
	if worst == SeverityOK {
		f := ok(strings.Join(fine, "; "))
		f.Evidence = ev
		return f, nil
	}
	return Finding{Severity: worst, Checked: true, Summary: strings.Join(problems, "; "), Evidence: ev,
		Hint: "add gateways to the region (three or more behind the balancer) or raise --gateway.max-streams (and this doctor's --max-streams) " +
			"so the survivors of any one gateway hold all of its sessions; map gateways to regions with --regions"}, nil
}

const nodesInStateSQL = `
SELECT n.id, n.kind, coalesce(n.site_id, ''), compute_now() - n.updated_at, coalesce(s.gateway_id, ''), coalesce(s.session_epoch, 0)
  FROM nodes n LEFT JOIN node_sessions s ON s.node_id = n.id
 WHERE n.state = $1
 ORDER BY n.updated_at, n.id`

type nodeRow struct {
	id, kind, site, gateway string
	age                     time.Duration
	epoch                   int64
}

func readNodes(ctx context.Context, d *Doctor, state string) (rows []nodeRow, total int, err error) {
	err = d.read(ctx, func(tx pgx.Tx) error {
		r, err := tx.Query(ctx, nodesInStateSQL, state)
		if err != nil {
			return err
		}
		if rows, err = pgx.CollectRows(r, func(r pgx.CollectableRow) (nodeRow, error) {
			var n nodeRow
			return n, r.Scan(&n.id, &n.kind, &n.site, &n.age, &n.gateway, &n.epoch)
		}); err != nil {
			return err
		}
		return tx.QueryRow(ctx, "SELECT count(*) FROM nodes WHERE state <> 'revoked'").Scan(&total)
	})
	return rows, total, err
}

func nodeEvidence(f *Finding, rows []nodeRow, state string) {
	f.add(state, "%d", len(rows))
	capped(f, "node", rows, func(n nodeRow) string {
		s := fmt.Sprintf("%s (%s", n.id, n.kind)
		if n.site != "" {
			s += " site " + n.site
		}
		s += fmt.Sprintf(") %s for %s", state, dur(n.age))
		if n.gateway != "" {
			s += fmt.Sprintf(", last gateway %s session epoch %d", n.gateway, n.epoch)
		}
		return s
	})
}

func checkNodesUnreachable(ctx context.Context, d *Doctor) (Finding, error) {
	rows, total, err := readNodes(ctx, d, "unreachable")
	if err != nil {
		return Finding{}, err
	}
	var f Finding
	hint := "check the hosts and their leasehold daemons (running? their logs) and the network path to the gateways' balancer; " +
		"an unreachable node keeps its allocation"
	switch {
	case len(rows) == 0:
		f = ok(fmt.Sprintf("no node is unreachable (%s registered)", plural(total, "node", "nodes")))
	case 2*len(rows) >= total:
		f = critical(fmt.Sprintf("%d of %d nodes unreachable, the oldest %s for %s", len(rows), total, rows[0].id, dur(rows[0].age)),
			"half the fleet or more is unreachable: suspect the path between nodes and gateways (balancer, DNS, TLS certificates, firewall) before the hosts; "+hint)
	default:
		f = warn(fmt.Sprintf("%d of %d nodes unreachable, the oldest %s for %s", len(rows), total, rows[0].id, dur(rows[0].age)), hint)
	}
	nodeEvidence(&f, rows, "unreachable")
	return f, nil
}

func checkNodesDisconnected(ctx context.Context, d *Doctor) (Finding, error) {
	rows, total, err := readNodes(ctx, d, "disconnected")
	if err != nil {
		return Finding{}, err
	}
	var f Finding
	if len(rows) == 0 {
		f = ok(fmt.Sprintf("no node is disconnected (%s registered)", plural(total, "node", "nodes")))
	} else {
		f = warn(fmt.Sprintf("%d of %d nodes disconnected, the oldest %s for %s", len(rows), total, rows[0].id, dur(rows[0].age)),
			"daemons redial with back-off (up to 60 s) after their gateway went away; nodes that stay disconnected point at the gateways "+
				"(gateways.none, gateways.headroom) or the balancer; they turn unreachable after the session lease and the gateway-loss grace")
	}
	nodeEvidence(&f, rows, "disconnected")
	return f, nil
}

const siteAgentsSQL = `
SELECT site_id, count(*), count(*) FILTER (WHERE state = 'connected'),
       string_agg(id || ' ' || state, ', ' ORDER BY id)
  FROM nodes WHERE kind = 'site_agent' AND site_id IS NOT NULL AND state <> 'revoked'
 GROUP BY site_id ORDER BY site_id`

const bootLeasesSQL = `
SELECT substr(name, length('site:') + 1, length(name) - length('site:') - length(':boot')), coalesce(owner, ''), epoch,
       expires_at > compute_now(), CASE WHEN isfinite(expires_at) THEN expires_at - compute_now() END
  FROM leases WHERE name LIKE 'site:%:boot'`

func checkSitesBoot(ctx context.Context, d *Doctor) (Finding, error) {
	type site struct {
		id           string
		agents, conn int
		list         string
	}
	var sites []site
	var boot map[string]leaseRow
	err := d.read(ctx, func(tx pgx.Tx) error {
		r, err := tx.Query(ctx, siteAgentsSQL)
		if err != nil {
			return err
		}
		if sites, err = pgx.CollectRows(r, func(r pgx.CollectableRow) (site, error) {
			var s site
			return s, r.Scan(&s.id, &s.agents, &s.conn, &s.list)
		}); err != nil {
			return err
		}
		boot, err = queryLeases(ctx, tx, bootLeasesSQL)
		return err
	})
	if err != nil {
		return Finding{}, err
	}
	if len(sites) == 0 {
		return ok("no site agents registered"), nil
	}
	worst := SeverityOK
	var none, single []string
	var ev []Evidence
	for _, s := range sites {
		l, has := boot[s.id]
		active := "no active boot agent"
		if has && l.live {
			active = fmt.Sprintf("boot lease %s", l)
		} else if has {
			active += fmt.Sprintf(" (boot lease %s)", l)
		}
		ev = append(ev, Evidence{"site", fmt.Sprintf("%s: %s; agents %s", s.id, active, s.list)})
		switch {
		case !has || !l.live:
			none = append(none, s.id)
			worst = SeverityCritical
		case s.conn < 2:
			single = append(single, s.id)
			if worst != SeverityCritical {
				worst = SeverityWarn
			}
		}
	}
	if worst == SeverityOK {
		f := ok(fmt.Sprintf("every site (%d) has an active boot agent and a connected standby", len(sites)))
		f.Evidence = ev
		return f, nil
	}
	var parts []string
	if len(none) > 0 {
		parts = append(parts, fmt.Sprintf("%s without an active boot agent (%s): machines there cannot PXE boot or be discovered",
			plural(len(none), "site", "sites"), strings.Join(none, ", ")))
	}
	if len(single) > 0 {
		parts = append(parts, fmt.Sprintf("%s with one connected agent only (%s): no standby to take over boot",
			plural(len(single), "site", "sites"), strings.Join(single, ", ")))
	}
	return Finding{Severity: worst, Checked: true, Summary: strings.Join(parts, "; "), Evidence: ev,
		Hint: "run two site agents per site and keep both connected: the boot lease goes to the first connected agent by node id once " +
			"the previous holder's lease expires; an agent that does not connect logs why (credentials, gateway address)"}, nil
}
