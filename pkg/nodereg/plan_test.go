package nodereg

import (
	"context"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestVerifyReadsOnlyLiveCredentialsThroughTheIndex: with thousands of
// nodes, each with many rotated-out credentials, Verify's statement is an
// index range scan of node_credentials_unexpired_idx (no sequential scan of
// node_credentials) and costs a handful of buffers; without the index it
// scans the table, so the bound tells the two apart.
func TestVerifyReadsOnlyLiveCredentialsThroughTheIndex(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t)
	_, err := db.Exec(ctx, `
INSERT INTO nodes (id) SELECT 'n' || i FROM generate_series(1, 2000) i;
-- 20 credentials a node: 18 rotated out, one in its grace, one live.
INSERT INTO node_credentials (node_id, credential_hash, revoked_at)
SELECT 'n' || i, sha256(convert_to(i || '/' || j, 'UTF8')),
       CASE WHEN j <= 18 THEN compute_now() - interval '1 day' * j
            WHEN j = 19 THEN compute_now() + interval '10 minutes' END
  FROM generate_series(1, 2000) i, generate_series(1, 20) j;
ANALYZE nodes; ANALYZE node_credentials;`)
	require.NoError(t, err)

	with := pgtest.Explain(t, db, liveHashesSQL, "n1234")
	t.Logf("with the index: %d blocks, %.2f ms, seq scans %v", with.Blocks, with.ExecMs, with.SeqScans)
	require.False(t, slices.Contains(with.SeqScans, "node_credentials"), "seq scans: %v", with.SeqScans)
	require.Less(t, with.Blocks, int64(20))

	without := pgtest.ExplainWithout(t, db, "node_credentials_unexpired_idx", liveHashesSQL, "n1234")
	t.Logf("without: %d blocks, seq scans %v", without.Blocks, without.SeqScans)
	require.Greater(t, without.Blocks, with.Blocks*5)
}
