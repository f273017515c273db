package doctor_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/services/doctor/internal/doctor"
	"github.com/leasehold/leasehold/services/doctor/internal/fixture"
)

// TestNodesClockSkew: connected sessions whose gateway measured a skew past
// 1 s warn, worst first, naming the node and its gateway; a session not
// measured yet, one within the threshold and a disconnected one do not.
func TestNodesClockSkew(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.db.Pool
	requireFinding(t, b.check(t, doctor.CodeNodesClockSkew), doctor.SeverityOK, "no connected node's clock is off by more than 1000ms (0 of 0 connected nodes measured)")

	fixture.Nodes(t, db, "n", 5, "connected", 0)
	fixture.Exec(t, db, `INSERT INTO node_sessions (node_id, gateway_id, session_epoch, state, session_expires_at, clock_skew_ms)
	  VALUES ('n-1', 'gw-a', 1, 'connected', compute_now() + interval '40 seconds', 250),
	         ('n-2', 'gw-a', 1, 'connected', compute_now() + interval '40 seconds', NULL),
	         ('n-3', 'gw-b', 1, 'connected', compute_now() + interval '40 seconds', -4200),
	         ('n-4', 'gw-b', 1, 'connected', compute_now() + interval '40 seconds', 1800),
	         ('n-5', 'gw-b', 1, 'disconnected', compute_now() - interval '1 minute', 90000)`)
	f := b.check(t, doctor.CodeNodesClockSkew)
	requireFinding(t, f, doctor.SeverityWarn, "2 of 4 connected nodes have a clock off the database's by more than 1000ms: worst n-3 at -4200ms")
	require.Contains(t, f.Hint, "chrony")
	requireEvidence(t, f, "node", "n-3 (gateway gw-b) skew -4200ms")
	requireEvidence(t, f, "node", "n-4 (gateway gw-b) skew +1800ms")

	fixture.Exec(t, db, `UPDATE node_sessions SET clock_skew_ms = 10 WHERE node_id IN ('n-3', 'n-4')`)
	requireFinding(t, b.check(t, doctor.CodeNodesClockSkew), doctor.SeverityOK, "(3 of 4 connected nodes measured)")
}
