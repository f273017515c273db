package doctor_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/services/doctor/internal/doctor"
	"github.com/leasehold/leasehold/services/doctor/internal/fixture"
)

func TestNodesVersionsHistogramAndMinimum(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.db.Pool
	requireFinding(t, b.check(t, doctor.CodeNodesVersions), doctor.SeverityOK, "no node has reported a daemon version yet")

	fixture.Nodes(t, db, "new", 3, "connected", 0)
	fixture.Nodes(t, db, "old", 2, "disconnected", 0)
	fixture.Nodes(t, db, "dev", 1, "connected", 0)
	fixture.Nodes(t, db, "fresh", 4, "registered", 0) // no Hello yet: no version
	fixture.Nodes(t, db, "gone", 1, "revoked", 0)
	fixture.Exec(t, db, `UPDATE nodes SET daemon_version = 'v1.4.2' WHERE id LIKE 'new-%'`)
	fixture.Exec(t, db, `UPDATE nodes SET daemon_version = 'v1.3.0-7-gabcdef0' WHERE id LIKE 'old-%'`)
	fixture.Exec(t, db, `UPDATE nodes SET daemon_version = 'devel' WHERE id LIKE 'dev-%'`)
	fixture.Exec(t, db, `UPDATE nodes SET daemon_version = 'v0.1.0' WHERE id LIKE 'gone-%'`)

	f := b.check(t, doctor.CodeNodesVersions)
	requireFinding(t, f, doctor.SeverityOK, "3 daemon versions across 6 nodes")
	require.Equal(t, []string{"v1.4.2: 3 nodes (e.g. new-1)", "v1.3.0-7-gabcdef0: 2 nodes (e.g. old-1)", "devel: 1 node (e.g. dev-1)"},
		evidenceOf(f, "version"))

	b.cfg.MinDaemonVersion = "1.4"
	f = b.check(t, doctor.CodeNodesVersions)
	requireFinding(t, f, doctor.SeverityWarn, "3 of 6 nodes run a daemon older than v1.4.0 (2 versions)")
	require.Equal(t, []string{"v1.3.0-7-gabcdef0: 2 nodes", "devel: 1 node"}, evidenceOf(f, "below_minimum"))
	require.Equal(t, []string{"v1.4.0"}, evidenceOf(f, "minimum"))

	b.cfg.MinDaemonVersion = "v1.3.0"
	f = b.check(t, doctor.CodeNodesVersions)
	requireFinding(t, f, doctor.SeverityWarn, "1 of 6 nodes run a daemon older than v1.3.0 (1 version)")

	b.cfg.MinDaemonVersion = "newest"
	_, err := doctor.New(b.cfg, db)
	require.ErrorContains(t, err, "--min-daemon-version")
}

func evidenceOf(f doctor.Finding, key string) []string {
	var out []string
	for _, e := range f.Evidence {
		if e.Key == key {
			out = append(out, e.Value)
		}
	}
	return out
}
