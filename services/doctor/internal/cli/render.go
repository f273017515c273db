package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/leasehold/leasehold/services/doctor/internal/doctor"
)

// ANSI colours for the status column, used only on a terminal.
const (
	ansiReset  = "\x1b[0m"
	ansiGreen  = "\x1b[32m"
	ansiYellow = "\x1b[33m"
	ansiRed    = "\x1b[1;31m"
	ansiPurple = "\x1b[35m"
)

// useColour decides --color auto|always|never: auto colours only a
// terminal, and never when NO_COLOR is set or TERM is dumb.
func useColour(mode string, out *os.File) bool {
	switch mode {
	case "always":
		return true
	case "never":
		return false
	}
	if os.Getenv("NO_COLOR") != "" || os.Getenv("TERM") == "dumb" {
		return false
	}
	fi, err := out.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

func label(s doctor.Severity) (text, colour string) {
	switch s {
	case doctor.SeverityOK:
		return "ok", ansiGreen
	case doctor.SeverityWarn:
		return "WARN", ansiYellow
	case doctor.SeverityCritical:
		return "CRIT", ansiRed
	}
	return "UNKNOWN", ansiPurple
}

// writeTable prints the report for people: one line per finding; evidence,
// reason and hint under every finding that is not ok (under all with
// verbose).
func writeTable(w io.Writer, rep doctor.Report, colour, verbose bool) {
	codeW := len("CHECK")
	for _, f := range rep.Findings {
		codeW = max(codeW, len(f.Code))
	}
	fmt.Fprintf(w, "leasehold doctor: %d checks at %s (database clock)\n\n", len(rep.Findings), rep.CheckedAt.UTC().Format(time.RFC3339))
	fmt.Fprintf(w, "%-7s  %-*s  %s\n", "STATUS", codeW, "CHECK", "SUMMARY")
	counts := map[doctor.Severity]int{}
	indent := strings.Repeat(" ", 9)
	for _, f := range rep.Findings {
		counts[f.Severity]++
		text, c := label(f.Severity)
		status := fmt.Sprintf("%-7s", text)
		if colour {
			status = c + status + ansiReset
		}
		fmt.Fprintf(w, "%s  %-*s  %s\n", status, codeW, f.Code, f.Summary)
		if f.Severity == doctor.SeverityOK && !verbose {
			continue
		}
		if f.Reason != "" {
			fmt.Fprintf(w, "%sreason: %s\n", indent, f.Reason)
		}
		for _, e := range f.Evidence {
			fmt.Fprintf(w, "%s%s: %s\n", indent, e.Key, e.Value)
		}
		if f.Hint != "" {
			fmt.Fprintf(w, "%shint: %s\n", indent, f.Hint)
		}
	}
	fmt.Fprintf(w, "\n%d ok, %d warn, %d critical, %d not checked: %s\n",
		counts[doctor.SeverityOK], counts[doctor.SeverityWarn], counts[doctor.SeverityCritical], counts[doctor.SeverityUnknown], rep.Worst())
}

// JSONReport is the --json document.
type JSONReport struct {
	// CheckedAt is the database time of the run.
	CheckedAt *time.Time `json:"checked_at,omitempty"`
	// Status is the worst severity: ok, warn, critical or unknown.
	Status string `json:"status"`
	// ExitCode is the process's exit status.
	ExitCode int `json:"exit_code"`
	// Error is set when the checks could not run at all.
	Error string `json:"error,omitempty"`
	// Findings holds one finding per check, ordered by code.
	Findings []doctor.Finding `json:"findings"`
}

func writeJSON(w io.Writer, rep doctor.Report) error {
	at := rep.CheckedAt
	doc := JSONReport{CheckedAt: &at, Status: rep.Worst().String(), ExitCode: rep.ExitCode(), Findings: rep.Findings}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(doc)
}

func writeJSONError(w io.Writer, err error) {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(JSONReport{Status: doctor.SeverityUnknown.String(), ExitCode: exitCannotCheck, Error: err.Error(), Findings: []doctor.Finding{}})
}
