package doctor

import (
	"google.golang.org/protobuf/types/known/timestamppb"

	doctorv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/doctor/v1"
)

// Proto returns the severity as DoctorService's enum.
func (s Severity) Proto() doctorv1.Severity {
	switch s {
	case SeverityOK:
		return doctorv1.Severity_SEVERITY_OK
	case SeverityWarn:
		return doctorv1.Severity_SEVERITY_WARN
	case SeverityCritical:
		return doctorv1.Severity_SEVERITY_CRITICAL
	}
	return doctorv1.Severity_SEVERITY_UNKNOWN
}

// Proto returns the finding as DoctorService's message.
func (f Finding) Proto() *doctorv1.Finding {
	out := &doctorv1.Finding{Code: f.Code, Severity: f.Severity.Proto(), Summary: f.Summary, Hint: f.Hint, Checked: f.Checked, Reason: f.Reason}
	for _, e := range f.Evidence {
		out.Evidence = append(out.Evidence, &doctorv1.Evidence{Key: e.Key, Value: e.Value})
	}
	return out
}

// Proto returns the report as a CheckResponse.
func (r Report) Proto() *doctorv1.CheckResponse {
	out := &doctorv1.CheckResponse{CheckedAt: timestamppb.New(r.CheckedAt)}
	for _, f := range r.Findings {
		out.Findings = append(out.Findings, f.Proto())
	}
	return out
}
