package main

import (
	"context"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/leasehold/leasehold/bench/internal/fleet"
	"github.com/leasehold/leasehold/bench/internal/harness"
)

type result struct {
	Scenario    string  `json:"scenario"`
	Nodes       int     `json:"nodes"`
	Gateways    int     `json:"gateways"`
	Timings     string  `json:"timings"`
	TimingsDesc string  `json:"timings_desc"`
	Machine     string  `json:"machine"`
	Database    string  `json:"database"`
	Date        string  `json:"date"`
	Producer    string  `json:"producer"`
	RatePerSec  float64 `json:"commands_per_sec"`
	HelloRate   float64 `json:"hello_rate_per_gateway"`
	MaxStreams  int     `json:"max_streams_per_gateway"`
	LossGrace   string  `json:"gateway_loss_grace"`

	InitialConnect float64 `json:"initial_connect_s"`
	Victim         string  `json:"victim"`
	NodesLost      int     `json:"nodes_lost"`
	Survivors      int     `json:"survivors"`
	ObservedFor    float64 `json:"observed_s"`

	Rehomed         int          `json:"rehomed"`
	BackOnVictim    int          `json:"rehomed_onto_victim"`
	Recovery        harness.Dist `json:"recovery_from_fault"`
	Gap             harness.Dist `json:"gap_stream_end_to_welcome"`
	AdmissionLimit  float64      `json:"admission_limit_s"`
	RecoveryVsLimit float64      `json:"recovery_max_vs_limit"`
	// RecoveryVsFloor divides by max(admission limit, the daemons' first
	// redial window of 1 s): below about 400 lost nodes the jitter, not
	// admission, bounds recovery.
	RecoveryVsFloor float64 `json:"recovery_max_vs_max_limit_or_redial_window"`
	GapVsLimit      float64 `json:"gap_max_vs_limit"`
	// Detect is fault -> the node's first stream end (how fast a node
	// learns its gateway is gone); Redials counts stream ends per re-homed
	// node between the fault and its new Welcome (1 = no pushback).
	Detect  harness.Dist `json:"detect_fault_to_stream_end"`
	Redials struct {
		Mean float64 `json:"mean"`
		Max  int     `json:"max"`
	} `json:"redials_per_rehomed_node"`
	// Timeline counts Welcomes per survivor per 250 ms after the fault
	// (first 10 s), to show whether admission ran at its rate throughout.
	Timeline map[string][]int `json:"welcomes_per_250ms"`

	PeakHellosPerSec    map[string]int `json:"peak_hellos_per_sec"`
	PushbacksAfterFault int64          `json:"pushbacks_after_fault"`
	PushbacksTotal      int64          `json:"pushbacks_total"`
	XactSteady          float64        `json:"xact_per_sec_steady"`
	XactAfter           float64        `json:"xact_per_sec_after_fault_mean"`
	XactPeak            float64        `json:"xact_per_sec_after_fault_peak"`
	// TopStatements are the statements run most often from the fault to
	// the end of the observation.
	TopStatements []harness.StatementCalls `json:"top_statements_after_fault"`

	CommandsCreated   int64            `json:"commands_created"`
	CreateErrors      int64            `json:"create_errors"`
	CommandStates     map[string]int64 `json:"command_states"`
	Lost              int64            `json:"lost_commands"`
	Executions        int64            `json:"executions"`
	Duplicates        int64            `json:"duplicate_executions"`
	MultiResults      int64            `json:"commands_with_several_results"`
	SettleSeconds     float64          `json:"settle_s"`
	FalseUnreachable  int              `json:"false_unreachable"`
	UnreachableEvents int64            `json:"unreachable_events"`
	UnreachableSample int              `json:"unreachable_samples"`

	SiteAgents    map[string]string `json:"site_agents,omitempty"`
	Zombie        *zombieResult     `json:"zombie,omitempty"`
	DrainExitCode int               `json:"drain_exit_code,omitempty"`

	Gate gate `json:"gate"`
}

type zombieResult struct {
	Paused   float64 `json:"paused_s"`
	Exited   bool    `json:"exited"`
	ExitCode int     `json:"exit_code"`
	// ServedAgain: ready again after the resume, holding its lease at a
	// new epoch (EpochAfter), without a restart.
	ServedAgain bool  `json:"served_again"`
	EpochAfter  int64 `json:"epoch_after"`
	// Rows the zombie wrote after its pause began (+1 s for statements
	// already on the wire) and before it took its lease again: writes of
	// the old holding.
	SessionWrites, DispatchWrites, ResultWrites, EventWrites int64
}

type gate struct {
	Pass     bool     `json:"pass"`
	Failures []string `json:"failures,omitempty"`
}

func (r *result) collect(ctx context.Context, f *fleet.Fleet, sim *fleet.Sim, smp *sampler, victim string, pausedAt time.Time, c config) error {
	db := f.DB.Pool
	r.CommandStates = map[string]int64{}
	rows, err := db.Query(ctx, `SELECT state /*bench*/, count(*) FROM commands GROUP BY state`)
	if err != nil {
		return err
	}
	for rows.Next() {
		var s string
		var n int64
		if err := rows.Scan(&s, &n); err != nil {
			return err
		}
		r.CommandStates[s] = n
		if s != "succeeded" {
			r.Lost += n
		}
	}
	rows.Close()
	r.Executions = sim.Executions.Load()
	r.Duplicates = sim.Duplicates.Load()
	if err := db.QueryRow(ctx, `SELECT count(*) /*bench*/ FROM (SELECT command_id FROM command_results_all GROUP BY command_id HAVING count(*) > 1) x`).Scan(&r.MultiResults); err != nil {
		return err
	}
	if err := db.QueryRow(ctx, `SELECT count(*) /*bench*/ FROM node_events WHERE kind = 'node.unreachable'`).Scan(&r.UnreachableEvents); err != nil {
		return err
	}
	smp.mu.Lock()
	r.FalseUnreachable = len(smp.falseNodes)
	r.UnreachableSample = smp.samples
	smp.mu.Unlock()
	r.XactSteady, r.XactAfter, r.XactPeak = smp.xactStats()
	if r.Zombie != nil {
		since := pausedAt.Add(time.Second)
		// The new holding starts at the lease's acquired_at (database clock).
		var retaken *time.Time
		if err := db.QueryRow(ctx, `SELECT acquired_at, epoch /*bench*/ FROM leases WHERE name = 'gateway:' || $1`, victim).Scan(&retaken, &r.Zombie.EpochAfter); err != nil {
			return err
		}
		until := time.Now().Add(time.Hour)
		if retaken != nil && retaken.After(since) {
			until = *retaken
		}
		q := func(sql string, dst *int64) error { return db.QueryRow(ctx, sql, victim, since, until).Scan(dst) }
		if err := q(`SELECT count(*) /*bench*/ FROM node_sessions WHERE gateway_id = $1 AND ((last_seen_at > $2 AND last_seen_at < $3) OR (connected_at > $2 AND connected_at < $3) OR (closed_at > $2 AND closed_at < $3))`, &r.Zombie.SessionWrites); err != nil {
			return err
		}
		if err := q(`SELECT count(*) /*bench*/ FROM commands WHERE dispatched_by = $1 AND dispatched_at > $2 AND dispatched_at < $3`, &r.Zombie.DispatchWrites); err != nil {
			return err
		}
		if err := q(`SELECT count(*) /*bench*/ FROM command_results_all WHERE gateway_id = $1 AND received_at > $2 AND received_at < $3`, &r.Zombie.ResultWrites); err != nil {
			return err
		}
		if err := q(`SELECT count(*) /*bench*/ FROM node_events WHERE gateway_id = $1 AND received_at > $2 AND received_at < $3 AND kind NOT LIKE 'node.%'`, &r.Zombie.EventWrites); err != nil {
			return err
		}
	}
	return nil
}

func (r *result) judge(c config) {
	fail := func(format string, args ...any) {
		r.Gate.Failures = append(r.Gate.Failures, fmt.Sprintf(format, args...))
	}
	if r.Rehomed < r.NodesLost {
		fail("%d of %d nodes never re-homed", r.NodesLost-r.Rehomed, r.NodesLost)
	}
	// A drained node keeps its stream until its random delay (up to
	// drain-max-delay) passes, so the drain gate is on the gap between the
	// stream's end and the new Welcome; kill and zombie are gated from the
	// fault itself.
	if c.scenario == "drain" {
		if r.Gap.Max >= 60 {
			fail("drain gap max %.1fs >= 60s", r.Gap.Max)
		}
		if r.DrainExitCode != 0 {
			fail("drained gateway exited %d, want 0", r.DrainExitCode)
		}
	} else if r.Recovery.Max >= 60 {
		fail("recovery max %.1fs >= 60s", r.Recovery.Max)
	}
	if r.FalseUnreachable > 0 {
		fail("%d false unreachable marks", r.FalseUnreachable)
	}
	if r.Duplicates > 0 {
		fail("%d duplicate executions", r.Duplicates)
	}
	if r.Lost > 0 {
		fail("%d lost commands (states %v)", r.Lost, r.CommandStates)
	}
	if z := r.Zombie; z != nil {
		if z.Exited {
			fail("zombie gateway exited (code %d): it must fence itself and stay up", z.ExitCode)
		}
		if !z.ServedAgain {
			fail("zombie gateway did not serve again after fencing itself")
		}
		if w := z.SessionWrites + z.DispatchWrites + z.ResultWrites + z.EventWrites; w > 0 {
			fail("zombie wrote %d rows after its pause (sessions %d, dispatches %d, results %d, events %d)",
				w, z.SessionWrites, z.DispatchWrites, z.ResultWrites, z.EventWrites)
		}
	}
	r.Gate.Pass = len(r.Gate.Failures) == 0
}

func (r *result) print(w io.Writer) {
	row := func(k, v string, args ...any) { fmt.Fprintf(w, "| %-38s | %s |\n", k, fmt.Sprintf(v, args...)) }
	fmt.Fprintf(w, "\nmulti-gateway: scenario %s, %d nodes, %d gateways behind HAProxy (%s timings)\n", r.Scenario, r.Nodes, r.Gateways, r.Timings)
	fmt.Fprintf(w, "%s; %s; machine %s; %s\n", r.TimingsDesc, r.Database, r.Machine, r.Date)
	fmt.Fprintf(w, "commands: %.0f/s via %s; worker --nodes.gateway-loss-grace %s; gateways --gateway.max-streams %d\n\n", r.RatePerSec, r.Producer, r.LossGrace, r.MaxStreams)
	fmt.Fprintf(w, "| %-38s | %s |\n|%s|%s|\n", "measure", "value", strings.Repeat("-", 40), strings.Repeat("-", 60))
	row("initial connect of all nodes", "%.1f s", r.InitialConnect)
	row("victim / nodes on it", "%s / %d", r.Victim, r.NodesLost)
	row("nodes re-homed", "%d / %d", r.Rehomed, r.NodesLost)
	row("recovery (fault -> new Welcome)", "%s", r.Recovery)
	row("gap (stream end -> new Welcome)", "%s", r.Gap)
	row("admission limit", "%.2f s = %d / (%d x %.0f/s)", r.AdmissionLimit, r.NodesLost, r.Survivors, r.HelloRate)
	row("recovery max / admission limit", "%.2fx (goal <= 1.25x); / max(limit, 1 s redial jitter) %.2fx", r.RecoveryVsLimit, r.RecoveryVsFloor)
	row("gap max / admission limit", "%.2fx", r.GapVsLimit)
	row("detect (fault -> stream end)", "%s", r.Detect)
	row("stream ends per re-homed node", "mean %.2f  max %d", r.Redials.Mean, r.Redials.Max)
	var gws []string
	for gw, v := range r.PeakHellosPerSec {
		gws = append(gws, fmt.Sprintf("%s %d", gw, v))
	}
	slices.Sort(gws)
	row("peak Hellos/s per gateway", "%s", strings.Join(gws, ", "))
	for _, gw := range slices.Sorted(maps.Keys(r.Timeline)) {
		row("Welcomes per 250 ms on "+gw, "%v", r.Timeline[gw])
	}
	row("pushbacks after fault (total)", "%d (%d)", r.PushbacksAfterFault, r.PushbacksTotal)
	row("database xact/s steady / after / peak", "%.0f / %.0f / %.0f", r.XactSteady, r.XactAfter, r.XactPeak)
	for i, st := range r.TopStatements {
		row(fmt.Sprintf("top statement %d after fault (calls)", i+1), "%d  %s", st.Calls, strings.ReplaceAll(st.Query, "|", "\\|"))
	}
	row("commands created (create errors)", "%d (%d)", r.CommandsCreated, r.CreateErrors)
	row("command states at end", "%v (settled in %.1f s)", r.CommandStates, r.SettleSeconds)
	row("lost commands", "%d", r.Lost)
	row("executions / duplicate executions", "%d / %d (commands with >1 result row: %d)", r.Executions, r.Duplicates, r.MultiResults)
	row("false unreachable marks", "%d (%d samples; node.unreachable events %d)", r.FalseUnreachable, r.UnreachableSample, r.UnreachableEvents)
	if z := r.Zombie; z != nil {
		row("zombie: paused, then", "%.0f s, exited=%v, served again at a new epoch=%v (epoch now %d)", z.Paused, z.Exited, z.ServedAgain, z.EpochAfter)
		row("zombie: rows of its old holding written after the pause", "sessions %d, dispatches %d, results %d, events %d", z.SessionWrites, z.DispatchWrites, z.ResultWrites, z.EventWrites)
	}
	if len(r.SiteAgents) > 0 {
		var sa []string
		for id, st := range r.SiteAgents {
			sa = append(sa, id+" "+st)
		}
		slices.Sort(sa)
		row("site agents at end", "%s", strings.Join(sa, ", "))
	}
	if r.Scenario == "drain" {
		row("drained gateway exit code", "%d", r.DrainExitCode)
	}
	row("observed after fault", "%.1f s", r.ObservedFor)
	if r.Gate.Pass {
		fmt.Fprintln(w, "\nGATE: PASS")
	} else {
		fmt.Fprintf(w, "\nGATE: FAIL\n  - %s\n", strings.Join(r.Gate.Failures, "\n  - "))
	}
}
