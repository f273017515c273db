package doctor_test

import (
	"fmt"
	"testing"

	"github.com/leasehold/leasehold/pkg/pgha"
	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/services/doctor/internal/doctor"
)

// TestDatabaseURLAndRealStandby runs doctor against a real primary and its
// synchronous streaming standby (pkg/pgha): on the primary db.url and
// db.replication are ok; on the standby both warn; a URL listing both
// servers warns without target_session_attrs=read-write and is ok with it,
// even with the standby listed first.
func TestDatabaseURLAndRealStandby(t *testing.T) {
	if _, err := pglocal.BinDir(); err != nil {
		t.Skip(err)
	}
	t.Parallel()
	p := pgha.Start(t, pgha.Options{Sync: true})
	b := &bundle{cfg: doctor.DefaultConfig()}
	find := func(url, code string) doctor.Finding {
		rep := b.runOn(t, url, code)
		f, _ := rep.Find(code)
		t.Logf("%s %s: %s%s", f.Severity, f.Code, f.Summary, evidenceText(f))
		return f
	}

	f := find(p.PrimaryURL(), doctor.CodeDBURL)
	requireFinding(t, f, doctor.SeverityOK, "one host, the primary")
	requireEvidence(t, f, "in_recovery", "false")
	f = find(p.PrimaryURL(), doctor.CodeDBReplication)
	requireFinding(t, f, doctor.SeverityOK, "1 standby synchronous, 0 asynchronous")
	requireEvidence(t, f, "standby", pgha.StandbyName, "streaming sync")

	f = find(p.StandbyURL(), doctor.CodeDBURL)
	requireFinding(t, f, doctor.SeverityWarn, "reaches a standby", "refused at start")
	requireEvidence(t, f, "in_recovery", "true")
	f = find(p.StandbyURL(), doctor.CodeDBReplication)
	requireFinding(t, f, doctor.SeverityWarn, "doctor is connected to a standby")

	both := fmt.Sprintf("postgres://postgres:postgres@127.0.0.1:%d,127.0.0.1:%d/%s?sslmode=disable",
		p.Standby().Port(), p.Primary().Port(), pgha.DBName)
	f = find(both, doctor.CodeDBURL)
	requireFinding(t, f, doctor.SeverityWarn, "lists 2 hosts without target_session_attrs=read-write")
	requireEvidence(t, f, "target_session_attrs", "any")
	f = find(both+"&target_session_attrs=read-write", doctor.CodeDBURL)
	requireFinding(t, f, doctor.SeverityOK, "2 hosts with target_session_attrs=read-write")
	requireEvidence(t, f, "in_recovery", "false")
	requireEvidence(t, f, "hosts", fmt.Sprintf("127.0.0.1:%d, 127.0.0.1:%d", p.Standby().Port(), p.Primary().Port()))
}
