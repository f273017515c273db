package main

import (
	"fmt"
	"io"
	"strings"
	"time"
)

type processResult struct {
	Name   string `json:"name"`
	PID    int    `json:"pid"`
	Exited bool   `json:"exited"`
	Tail   string `json:"tail,omitempty"`
}

type scenarioResult struct {
	Scenario    string `json:"scenario"`
	Replication string `json:"replication"`
	// Leases is how many leases were held just before the fault.
	Leases int `json:"leases"`
	// Down is the time from the fault to the database being back (started
	// or promoted), seconds.
	Down float64 `json:"down_s"`
	// LeasesBack is the time from the database being back to every one of
	// Leases held again; ReadyBack to every process answering /readyz 200.
	LeasesBack float64 `json:"leases_back_s"`
	ReadyBack  float64 `json:"ready_back_s"`
	// NodesBack is the time from the database being back to every node
	// holding a session again (sampled once every process is ready, so
	// the sessions a fencing gateway closed are counted); NodesAfterReady
	// is the same from every process being ready: the nodes' own delay,
	// whose target is 5 s (-1: not every node came back).
	NodesBack       float64 `json:"nodes_back_s"`
	NodesAfterReady float64 `json:"nodes_after_ready_s"`
	// CompletedBack is the time from the database being back until every
	// acknowledged command still in the table had completed (0: some never
	// did); it includes -after and the nodes' reconnection back-off.
	CompletedBack float64 `json:"completed_back_s"`
	// Acknowledged commands (CreateCommand returned OK), CreateFailed
	// calls, Completed (succeeded or failed on the node), Lost
	// (acknowledged, never completed) and LostAbsent (acknowledged and not
	// even in the commands table).
	Acknowledged int   `json:"acknowledged"`
	CreateFailed int   `json:"create_failed"`
	Completed    int   `json:"completed"`
	Lost         int   `json:"lost"`
	LostAbsent   int   `json:"lost_absent"`
	Executions   int64 `json:"executions"`
	Duplicates   int64 `json:"duplicates"`
	// Restarted counts processes that exited (the bench restarts none).
	Restarted int             `json:"restarted"`
	Processes []processResult `json:"processes"`
	// Overlaps: (lease, epoch) pairs seen with two owners by polling, and
	// from the lease log the same, plus grants made while another owner's
	// grant was valid.
	HolderPairsSeen       int      `json:"holder_pairs_seen"`
	TwoHoldersSeen        []string `json:"two_holders_seen,omitempty"`
	LogRows               int      `json:"lease_log_rows"`
	LogSameEpochTwoOwners int      `json:"lease_log_same_epoch_two_owners"`
	LogOverlaps           int      `json:"lease_log_overlapping_validity"`
	Error                 string   `json:"error,omitempty"`
}

// nodesBackTarget is how soon after the control plane serves again every
// node must hold a session (the gateways push Hellos back with a short
// delay while fenced, which resets the nodes' back-off).
const nodesBackTarget = 5 * time.Second

func (s *scenarioResult) overlaps() int {
	return len(s.TwoHoldersSeen) + s.LogSameEpochTwoOwners + s.LogOverlaps
}

type result struct {
	Machine   string            `json:"machine"`
	Date      string            `json:"date"`
	Timings   string            `json:"timings"`
	Nodes     int               `json:"nodes"`
	Rate      float64           `json:"rate_per_s"`
	Outage    float64           `json:"outage_s"`
	AsyncLag  float64           `json:"async_lag_s"`
	Scenarios []*scenarioResult `json:"scenarios"`
	Gate      struct {
		Pass     bool     `json:"pass"`
		Failures []string `json:"failures,omitempty"`
	} `json:"gate"`
}

// judge: every scenario recovers in place (every lease held again, no
// process exited), runs no command twice and shows no two holders; only an
// asynchronous promotion may lose acknowledged commands.
func (r *result) judge() {
	fail := func(s *scenarioResult, format string, args ...any) {
		r.Gate.Failures = append(r.Gate.Failures, s.Scenario+": "+fmt.Sprintf(format, args...))
	}
	for _, s := range r.Scenarios {
		if s.Error != "" {
			fail(s, "%s", s.Error)
		}
		if s.Restarted > 0 {
			fail(s, "%d processes exited", s.Restarted)
		}
		if s.Duplicates > 0 {
			fail(s, "%d commands executed twice", s.Duplicates)
		}
		if s.overlaps() > 0 {
			fail(s, "two holders: %d seen, %d same epoch in the log, %d overlapping validity", len(s.TwoHoldersSeen), s.LogSameEpochTwoOwners, s.LogOverlaps)
		}
		if s.Lost > 0 && s.Scenario != "promote-async" {
			fail(s, "%d acknowledged commands never completed", s.Lost)
		}
		if s.NodesAfterReady < 0 || s.NodesAfterReady > nodesBackTarget.Seconds() {
			fail(s, "nodes back %.1f s after every process was ready (target %s; -1: not all)", s.NodesAfterReady, nodesBackTarget)
		}
	}
	r.Gate.Pass = len(r.Gate.Failures) == 0
}

func (r *result) print(w io.Writer) {
	fmt.Fprintf(w, "\ndbfailover: %s, timings %s, %d nodes, %.0f commands/s, outage %.0fs, async lag %.0fs\n\n",
		r.Machine, r.Timings, r.Nodes, r.Rate, r.Outage, r.AsyncLag)
	fmt.Fprintf(w, "| scenario | replication | down | every lease held again | every process ready | every node connected (after ready) | acknowledged | completed | lost | duplicates | processes restarted | two holders |\n")
	fmt.Fprintf(w, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
	for _, s := range r.Scenarios {
		fmt.Fprintf(w, "| %s | %s | %.1f s | %.1f s | %.1f s | %.1f s (%.1f s) | %d | %d | %d | %d | %d | %d |\n", s.Scenario, s.Replication, s.Down, s.LeasesBack, s.ReadyBack,
			s.NodesBack, s.NodesAfterReady, s.Acknowledged, s.Completed, s.Lost, s.Duplicates, s.Restarted, s.overlaps())
	}
	fmt.Fprintln(w)
	for _, s := range r.Scenarios {
		fmt.Fprintf(w, "%s: %d leases; %d create calls failed during the fault; %d executions; %d lost acknowledged commands absent from the table; "+
			"every acknowledged command left completed %.1f s after the database was back; %d (lease, epoch) pairs polled, %d lease log rows\n",
			s.Scenario, s.Leases, s.CreateFailed, s.Executions, s.LostAbsent, s.CompletedBack, s.HolderPairsSeen, s.LogRows)
		for _, b := range s.TwoHoldersSeen {
			fmt.Fprintf(w, "  two holders: %s\n", b)
		}
		for _, p := range s.Processes {
			if p.Exited {
				fmt.Fprintf(w, "  %s (pid %d) exited:\n    %s\n", p.Name, p.PID, strings.ReplaceAll(p.Tail, "\n", "\n    "))
			}
		}
		if s.Error != "" {
			fmt.Fprintf(w, "  error: %s\n", s.Error)
		}
	}
	if r.Gate.Pass {
		fmt.Fprintln(w, "\nPASS")
	} else {
		fmt.Fprintln(w, "\nFAIL:\n  "+strings.Join(r.Gate.Failures, "\n  "))
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
