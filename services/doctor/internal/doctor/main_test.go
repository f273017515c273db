package doctor_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/services/doctor/internal/doctor"
	"github.com/leasehold/leasehold/services/doctor/internal/fixture"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type bundle struct {
	db *pgtest.DB
	// direct is the database's URL straight to the server, even when the
	// suite runs through PgBouncer (LEASEHOLD_TEST_PGBOUNCER).
	direct string
	cfg    doctor.Config
}

func setup(t *testing.T) *bundle {
	t.Helper()
	db := pgtest.NewDB(t)
	return &bundle{db: db, direct: fixture.DirectURL(pgtest.Server(t).AdminURL(), db.Name), cfg: doctor.DefaultConfig()}
}

// pool opens a doctor pool on url the way the CLI does (no statement
// cache, so it also works through PgBouncer in transaction mode).
func pool(t *testing.T, url string) *pgxpool.Pool {
	t.Helper()
	p, err := pgdb.Connect(context.Background(), pgdb.Config{URL: url, AppName: "doctor-test", MaxConns: 4, Pooler: true, ReadOnly: true})
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return p
}

func (b *bundle) runOn(t *testing.T, url string, codes ...string) doctor.Report {
	t.Helper()
	d, err := doctor.New(b.cfg, pool(t, url))
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rep, err := d.Run(ctx, codes)
	require.NoError(t, err)
	return rep
}

// check runs one check on the test database and returns its finding.
func (b *bundle) check(t *testing.T, code string) doctor.Finding {
	t.Helper()
	rep := b.runOn(t, b.db.URL, code)
	require.Len(t, rep.Findings, 1)
	f := rep.Findings[0]
	require.Equal(t, code, f.Code)
	t.Logf("%s %s: %s%s", f.Severity, f.Code, f.Summary, evidenceText(f))
	return f
}

func evidenceText(f doctor.Finding) string {
	var sb strings.Builder
	for _, e := range f.Evidence {
		sb.WriteString("\n    " + e.Key + ": " + e.Value)
	}
	if f.Hint != "" {
		sb.WriteString("\n    hint: " + f.Hint)
	}
	if f.Reason != "" {
		sb.WriteString("\n    reason: " + f.Reason)
	}
	return sb.String()
}

func requireFinding(t *testing.T, f doctor.Finding, sev doctor.Severity, summaryParts ...string) {
	t.Helper()
	require.Equal(t, sev, f.Severity, "%s: %s%s", f.Code, f.Summary, evidenceText(f))
	require.Equal(t, sev != doctor.SeverityUnknown, f.Checked)
	for _, p := range summaryParts {
		require.Contains(t, f.Summary, p)
	}
	if sev == doctor.SeverityWarn || sev == doctor.SeverityCritical || sev == doctor.SeverityUnknown {
		require.NotEmpty(t, f.Hint, "a finding that is not ok says what to do")
	}
}

func requireEvidence(t *testing.T, f doctor.Finding, key string, parts ...string) {
	t.Helper()
	for _, e := range f.Evidence {
		if e.Key != key {
			continue
		}
		all := true
		for _, p := range parts {
			all = all && strings.Contains(e.Value, p)
		}
		if all {
			return
		}
	}
	t.Fatalf("%s: no evidence %q containing %q in%s", f.Code, key, parts, evidenceText(f))
}
