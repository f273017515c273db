package doctor

import (
	"fmt"
	"slices"
	"time"
)

// Severity is how bad a finding is.
type Severity int

// Severities, in the order of DoctorService's enum.
const (
	SeverityOK Severity = iota + 1
	SeverityWarn
	SeverityCritical
	// SeverityUnknown: the check could not be run (see Finding.Reason).
	SeverityUnknown
)

// String is the lower-case name used in the table and in JSON.
func (s Severity) String() string {
	switch s {
	case SeverityOK:
		return "ok"
	case SeverityWarn:
		return "warn"
	case SeverityCritical:
		return "critical"
	case SeverityUnknown:
		return "unknown"
	}
	return fmt.Sprintf("severity(%d)", int(s))
}

// MarshalText makes a Severity its lower-case name in JSON.
func (s Severity) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// UnmarshalText parses the lower-case name.
func (s *Severity) UnmarshalText(b []byte) error {
	for _, v := range []Severity{SeverityOK, SeverityWarn, SeverityCritical, SeverityUnknown} {
		if v.String() == string(b) {
			*s = v
			return nil
		}
	}
	return fmt.Errorf("unknown severity %q", b)
}

// Gauge is the value of leasehold_doctor_finding: 0 ok, 1 warn, 2 critical,
// -1 unchecked.
func (s Severity) Gauge() float64 {
	switch s {
	case SeverityOK:
		return 0
	case SeverityWarn:
		return 1
	case SeverityCritical:
		return 2
	}
	return -1
}

// rank orders severities for the overall status: an unchecked finding is
// worse than ok (it must not pass) and better than warn.
func (s Severity) rank() int {
	switch s {
	case SeverityOK:
		return 0
	case SeverityUnknown:
		return 1
	case SeverityWarn:
		return 2
	case SeverityCritical:
		return 3
	}
	return 1
}

// Evidence is one key/value fact behind a finding. Keys may repeat (one
// entry per row).
type Evidence struct {
	Key   string `json:"key"`
	Value string `json:"value"`
}

// Finding is the outcome of one check.
type Finding struct {
	// Code identifies the check ("workers.queue").
	Code string `json:"code"`
	// Severity is ok, warn, critical, or unknown when not checked.
	Severity Severity `json:"severity"`
	// Summary is one line for operators.
	Summary string `json:"summary"`
	// Evidence is the data the finding was drawn from.
	Evidence []Evidence `json:"evidence"`
	// Hint says what to do; empty when nothing.
	Hint string `json:"hint,omitempty"`
	// Checked is false when the check could not be run.
	Checked bool `json:"checked"`
	// Reason says why the check could not be run.
	Reason string `json:"reason,omitempty"`
}

// add appends an evidence entry.
func (f *Finding) add(key, format string, args ...any) {
	f.Evidence = append(f.Evidence, Evidence{Key: key, Value: fmt.Sprintf(format, args...)})
}

// Report is the outcome of one run of the checks.
type Report struct {
	// CheckedAt is compute_now() when the run started.
	CheckedAt time.Time
	// Findings holds one finding per check run, ordered by code.
	Findings []Finding
}

// Worst is the overall severity: critical > warn > unknown > ok.
func (r Report) Worst() Severity {
	worst := SeverityOK
	for _, f := range r.Findings {
		if f.Severity.rank() > worst.rank() {
			worst = f.Severity
		}
	}
	return worst
}

// Exit statuses of `leasehold-doctor check`, as monitoring plugins use them:
// a critical finding outranks a warning, which outranks a finding that could
// not be checked.
const (
	ExitOK       = 0
	ExitWarn     = 1
	ExitCritical = 2
	// ExitUnknown: something could not be checked (the database did not
	// answer, a check failed to run, or the command line was wrong). It
	// never means healthy.
	ExitUnknown = 3
)

// ExitCode is the CLI's exit status: ExitCritical when any finding is
// critical, else ExitWarn when any is a warning, else ExitUnknown when any
// could not be checked, else ExitOK.
func (r Report) ExitCode() int {
	switch r.Worst() {
	case SeverityOK:
		return ExitOK
	case SeverityWarn:
		return ExitWarn
	case SeverityCritical:
		return ExitCritical
	}
	return ExitUnknown
}

// Find returns the finding with code, if the report has it.
func (r Report) Find(code string) (Finding, bool) {
	i := slices.IndexFunc(r.Findings, func(f Finding) bool { return f.Code == code })
	if i < 0 {
		return Finding{}, false
	}
	return r.Findings[i], true
}
