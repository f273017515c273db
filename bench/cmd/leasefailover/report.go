package main

import (
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/leasehold/leasehold/bench/internal/harness"
)

type scenarioResult struct {
	Takeovers    []time.Duration `json:"-"`
	RowTakeovers []time.Duration `json:"-"`
	Dist         harness.Dist    `json:"takeover"`
	RowDist      harness.Dist    `json:"leader_row_takeover,omitzero"`
	Noticed      []time.Duration `json:"-"`
	NoticeDist   harness.Dist    `json:"server_noticed,omitzero"`
	LeasesMoved  []int           `json:"leases_moved,omitempty"`
	BadExits     int             `json:"bad_exits"`
}

type loadResult struct {
	Members          int     `json:"members"`
	Liveness         bool    `json:"liveness"`
	Window           float64 `json:"window_s"`
	Statements       int64   `json:"statements"`
	StatementsPerSec float64 `json:"statements_per_sec"`
	PerMember        float64 `json:"statements_per_sec_per_member"`
	XactsPerSec      float64 `json:"xact_per_sec"`
	ShardsHeld       int     `json:"shards_held_live"`
}

type result struct {
	Machine   string                     `json:"machine"`
	Database  string                     `json:"database"`
	Date      string                     `json:"date"`
	Runs      int                        `json:"runs"`
	Timings   string                     `json:"timings"`
	Leasehold map[string]*scenarioResult `json:"leasehold"`
	River     map[string]*scenarioResult `json:"river"`
	Ratio     map[string]float64         `json:"ratio_leasehold_over_river_work_p50"`
	RatioRow  map[string]float64         `json:"ratio_leasehold_over_river_leader_row_p50"`
	Load      []loadResult               `json:"coordination_load"`
	Gate      struct {
		Pass     bool     `json:"pass"`
		Failures []string `json:"failures,omitempty"`
	} `json:"gate"`
}

// Gates: a crash with a liveness session is taken over within 4 s (the
// liveness target; p50 <= 3 s is reported), a crash on the TTL path alone or
// a pause within the reference's 22 s (TTL 15 s + renew 5 s + 2 s), a
// SIGTERM within one renewal period (5 s).
var limits = map[string]float64{"crash": 4, "conn-killed": 22, "vanish": 22, "crash-ttl": 22, "pause": 22, "sigterm": 5}

func (r *result) judge() {
	r.Ratio, r.RatioRow = map[string]float64{}, map[string]float64{}
	for s, lh := range r.Leasehold {
		if lh.Dist.Max > limits[s] {
			r.Gate.Failures = append(r.Gate.Failures, fmt.Sprintf("leasehold %s: takeover max %.2fs > %.0fs", s, lh.Dist.Max, limits[s]))
		}
		if lh.BadExits > 0 {
			r.Gate.Failures = append(r.Gate.Failures, fmt.Sprintf("leasehold %s: %d workers did not exit 0 on SIGTERM", s, lh.BadExits))
		}
		if rv := r.River[s]; rv != nil && rv.Dist.P50 > 0 {
			r.Ratio[s] = lh.Dist.P50 / rv.Dist.P50
		}
		if rv := r.River[s]; rv != nil && rv.RowDist.P50 > 0 {
			r.RatioRow[s] = lh.Dist.P50 / rv.RowDist.P50
		}
	}
	r.Gate.Pass = len(r.Gate.Failures) == 0
}

func (r *result) print(w io.Writer) {
	fmt.Fprintf(w, "\nleasefailover: %d runs per scenario; %s; machine %s; %s\n", r.Runs, r.Database, r.Machine, r.Date)
	fmt.Fprintf(w, "timings: %s\n\n", r.Timings)
	fmt.Fprintln(w, "| scenario | system | measured until | p50 | p90 | p99 | max | min | n |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|")
	line := func(s, sys, what string, d harness.Dist) {
		fmt.Fprintf(w, "| %s | %s | %s | %.2f s | %.2f s | %.2f s | %.2f s | %.2f s | %d |\n", s, sys, what, d.P50, d.P90, d.P99, d.Max, d.Min, d.N)
	}
	for _, s := range []string{"crash", "crash-ttl", "conn-killed", "vanish", "pause", "sigterm"} {
		if lh := r.Leasehold[s]; lh != nil {
			if lh.NoticeDist.N > 0 {
				line(s, "leasehold", "the server ends the victim's liveness session", lh.NoticeDist)
			}
			line(s, "leasehold", "survivor holds every lease of the victim", lh.Dist)
		}
		if rv := r.River[s]; rv != nil {
			line(s, "River", "survivor's leader-only work starts", rv.Dist)
			if rv.RowDist.N > 0 {
				line(s, "River", "river_leader row names the survivor", rv.RowDist)
			}
		}
	}
	if len(r.Ratio) > 0 {
		fmt.Fprintln(w)
		for _, s := range []string{"crash", "sigterm"} {
			if v, ok := r.Ratio[s]; ok {
				fmt.Fprintf(w, "ratio leasehold/River (p50), %s: %.3f against River's leader-only work starting, %.3f against its river_leader row\n",
					s, v, r.RatioRow[s])
			}
		}
	}
	if len(r.Load) > 0 {
		fmt.Fprintln(w, "\n| members | liveness | statements/s | per member | xact/s | live shard leases |")
		fmt.Fprintln(w, "|---|---|---|---|---|---|")
		for _, l := range r.Load {
			fmt.Fprintf(w, "| %d | %v | %.1f | %.2f | %.1f | %d |\n", l.Members, l.Liveness, l.StatementsPerSec, l.PerMember, l.XactsPerSec, l.ShardsHeld)
		}
	}
	if r.Gate.Pass {
		fmt.Fprintln(w, "\nGATE: PASS (crash with a liveness session <= 4 s; crash on the TTL path, killed connections, vanished host and pause <= 22 s; SIGTERM <= 5 s)")
	} else {
		fmt.Fprintf(w, "\nGATE: FAIL\n  - %s\n", strings.Join(r.Gate.Failures, "\n  - "))
	}
}
