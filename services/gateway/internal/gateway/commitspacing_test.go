package gateway

import (
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgtest"
)

// ingestWrites is how many group commits the gateway has written and how
// many reports they held.
func ingestWrites(t *testing.T, g *Gateway) (writes, reports uint64) {
	t.Helper()
	var m dto.Metric
	require.NoError(t, g.m.ingestBatch.Write(&m))
	return m.GetHistogram().GetSampleCount(), uint64(m.GetHistogram().GetSampleSum())
}

// TestCommitSpacingGroupsReports: with --gateway.commit-spacing 1s the
// first result after a quiet spell is written at once, alone; the next
// waits in the queue for the spacing, and the two sent while it waits
// share its transaction.
func TestCommitSpacingGroupsReports(t *testing.T) {
	t.Parallel()
	cfg := windowConfig(8)
	cfg.CommitSpacing = time.Second
	db := pgtest.NewDB(t)
	c := &windowCase{g: startGateway(t, db, cfg), db: db}
	c.cred = registerNodes(t, db, "n", 1)[0]
	c.ids = insertOrdered(t, db, "n-0", 4)
	g := c.g
	s := c.connect(t)
	for _, want := range c.ids {
		require.Equal(t, want, recvCommand(t, s))
	}
	writes0, reports0 := ingestWrites(t, g)

	sendResult(t, s, c.ids[0])
	require.Eventually(t, func() bool { w, _ := ingestWrites(t, g); return w > writes0 }, 10*time.Second, time.Millisecond,
		"the first result after a quiet spell is written at once")
	require.Equal(t, 1, commandStates(t, db, "n-0")["succeeded"])
	// The next result waits in the queue for the spacing (without it, it
	// would be written at once, alone); the two after it join it there.
	sendResult(t, s, c.ids[1])
	require.Eventually(t, func() bool {
		g.ingest.mu.Lock()
		defer g.ingest.mu.Unlock()
		return len(g.ingest.queue) == 1 && g.ingest.queue[0].command == c.ids[1]
	}, 10*time.Second, time.Millisecond, "the second result never waited in the queue")
	for _, id := range c.ids[2:] {
		sendResult(t, s, id)
	}
	// The batch metric is observed just after the commit: wait on it,
	// not on the rows.
	require.Eventually(t, func() bool { _, r := ingestWrites(t, g); return r-reports0 >= 4 }, 20*time.Second, time.Millisecond)
	writes, reports := ingestWrites(t, g)
	require.Equal(t, uint64(2), writes-writes0, "one write for the first result, one for the three after it")
	require.Equal(t, uint64(4), reports-reports0)
	require.Equal(t, 4, commandStates(t, db, "n-0")["succeeded"])
}
