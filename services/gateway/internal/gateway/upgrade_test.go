package gateway

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/migrations"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgnotify"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// The schema version of the previous release: its gateways store results
// in command_results and write the 'acknowledged' state.
const previousSchema = 30

// TestRollingUpgradeOfTheCommandsSchema: the previous release's gateway
// statements (prevIngestSQL, verbatim) keep working while the migrations
// that fold results into commands and make the idempotency index partial
// run, and after them; then this release's gateway finishes what the
// previous one started, and readers see one result per command and the
// acknowledged state written either way.
func TestRollingUpgradeOfTheCommandsSchema(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmpty(t)
	if db.DirectURL == "" {
		t.Skip("migrations take a session lock: they need a direct connection")
	}
	ctx := context.Background()
	sqldb, err := migrations.Open(db.DirectURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sqldb.Close() })
	st, err := migrations.UpTo(ctx, sqldb, previousSchema, nil)
	require.NoError(t, err)
	require.EqualValues(t, previousSchema, st.Current)
	creds := registerNodes(t, db, "n", 1)

	// The previous release at work: a command finished, one acknowledged.
	prev := &previousGateway{t: t, db: db}
	done, acked := prev.command(), prev.command()
	require.Equal(t, "stored", prev.result(done, "r-done"))
	prev.ack(acked)

	// The migrations run while the previous release keeps writing.
	stop, loopErr := make(chan struct{}), make(chan error, 1)
	rounds := 0
	go func() {
		defer close(loopErr)
		for {
			select {
			case <-stop:
				return
			default:
			}
			id := prev.command()
			prev.ack(id)
			if out := prev.result(id, "r-"+id); out != "stored" {
				loopErr <- fmt.Errorf("previous release's result for %s: %s", id, out)
				return
			}
			rounds++
		}
	}()
	st, err = migrations.Up(ctx, sqldb, nil)
	close(stop)
	require.NoError(t, <-loopErr)
	require.NoError(t, err)
	require.Greater(t, st.Current, int64(previousSchema))
	t.Logf("the previous release finished %d commands while the migrations ran", rounds)
	after := prev.command()
	prev.ack(after)
	require.Equal(t, "stored", prev.result(after, "r-after"), "the previous release works on the new schema")
	require.Equal(t, "acknowledged", readState(t, db, acked), "an ack the previous release wrote reads as acknowledged")

	// This release's gateway takes the node over: the acknowledged
	// command is replayed, its result goes into its row, and the result
	// stored by the previous release is a duplicate.
	g := startGateway(t, db, testConfig())
	s := dialRaw(t, g.Addr())
	s.welcome(t, "n-0", creds[0])
	require.Equal(t, acked, recvCommand(t, s), "the in-flight command is replayed")
	fresh := dispatchedTo(t, db, s, "n-0")
	require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandAck{CommandAck: &nodev1.CommandAck{CommandId: fresh}}}))
	require.Eventually(t, func() bool { return readState(t, db, fresh) == "acknowledged" }, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, "dispatched", commandState(t, db, fresh), "this release's ack changes no indexed column")
	for _, id := range []string{acked, fresh} {
		sendResult(t, s, id)
	}
	require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandResult{CommandResult: &nodev1.CommandResult{
		CommandId: done, ResultId: "r-done"}}}))
	s.sync(t, 1)
	require.Equal(t, 1.0, testutil.ToFloat64(g.m.results.WithLabelValues("duplicate")))
	for _, id := range []string{done, acked, fresh, after} {
		var n int
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM command_results_all WHERE command_id = $1`, id).Scan(&n))
		require.Equal(t, 1, n, "one result for %s", id)
		require.Equal(t, "succeeded", readState(t, db, id))
	}
	var inRow int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM commands WHERE result_id IS NOT NULL`).Scan(&inRow))
	require.Equal(t, 2, inRow, "this release stores results in the command's row")
}

// readState is the state a reader shows (command_state).
func readState(t *testing.T, db *pgtest.DB, id string) string {
	t.Helper()
	var st string
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT command_state(state, acked_at) FROM commands WHERE id = $1`, id).Scan(&st))
	return st
}

// previousGateway runs the previous release's statements for node n-0.
type previousGateway struct {
	t  *testing.T
	db *pgtest.DB
}

// command inserts a command and dispatches it as the previous release did.
func (p *previousGateway) command() string {
	ctx := context.Background()
	var id string
	require.NoError(p.t, p.db.Pool.QueryRow(ctx, `INSERT INTO commands (node_id, kind, payload) VALUES ('n-0', 'exec', '') RETURNING id`).Scan(&id))
	_, err := p.db.Pool.Exec(ctx, `
UPDATE commands SET state = 'dispatched', dispatch_count = 1, dispatched_at = compute_now(),
       dispatched_by = 'gw-prev', dispatch_epoch = 1
 WHERE id = $1`, id)
	require.NoError(p.t, err)
	return id
}

// ingest runs prevIngestSQL with results (their ids resultIDs, exit 0)
// and acks, and returns each one's outcome in that order.
func (p *previousGateway) ingest(results, resultIDs, acks []string) []string {
	var (
		rI, aI, rExit, noInt []int32
		rNode, rErr, aNode   []string
		noText               []string
		rOut, noBytes        [][]byte
		rTime, noTime        []*time.Time
		rEpoch, noBig        []int64
		noBool               []bool
	)
	for i := range results {
		rI, rNode, rExit, rOut = append(rI, int32(i)), append(rNode, "n-0"), append(rExit, 0), append(rOut, []byte{})
		rErr, rTime, rEpoch = append(rErr, ""), append(rTime, nil), append(rEpoch, 1)
	}
	for i := range acks {
		aI, aNode = append(aI, int32(len(results)+i)), append(aNode, "n-0")
	}
	rows, err := p.db.Pool.Query(context.Background(), prevIngestSQL, "gw-prev",
		rI, rNode, resultIDs, results, rExit, rOut, rErr, rTime, rTime, rEpoch,
		aI, aNode, acks,
		noInt, noText, noText, noText, noText, noTime, noBig, noBig,
		noInt, noText, noText, noBig, noText, noBytes, int64(1<<20),
		noInt, noText, noText, noText, noBool)
	require.NoError(p.t, err)
	defer rows.Close()
	out := make([]string, len(results)+len(acks))
	for rows.Next() {
		var (
			i       int32
			outcome string
			tp      *string
		)
		require.NoError(p.t, rows.Scan(&i, &outcome, &tp))
		if i >= 0 {
			out[i] = outcome
		}
	}
	require.NoError(p.t, rows.Err())
	return out
}

func (p *previousGateway) result(commandID, resultID string) string {
	return p.ingest([]string{commandID}, []string{resultID}, nil)[0]
}

func (p *previousGateway) ack(commandID string) {
	require.Equal(p.t, "ok", p.ingest(nil, nil, []string{commandID})[0])
}

// prevIngestSQL is the previous release's group commit, verbatim.
const prevIngestSQL = `
WITH r AS (
  SELECT * FROM unnest($2::int[], $3::text[], $4::text[], $5::text[], $6::int[], $7::bytea[], $8::text[],
                       $9::timestamptz[], $10::timestamptz[], $11::bigint[])
    AS r(i, node_id, id, command_id, exit_code, output, error, started_at, finished_at, session_epoch)
), ins AS (
  INSERT INTO command_results (node_id, id, command_id, exit_code, output, error, started_at, finished_at, gateway_id, session_epoch)
  SELECT r.node_id, r.id, r.command_id, r.exit_code, r.output, r.error, r.started_at, r.finished_at, $1, r.session_epoch
    FROM r JOIN commands c ON c.id = r.command_id AND c.node_id = r.node_id
   WHERE NOT EXISTS (SELECT 1 FROM command_results x WHERE x.command_id = r.command_id)
  ON CONFLICT DO NOTHING
  RETURNING node_id, id, command_id, exit_code, error
), fin AS (
  UPDATE commands c SET state = CASE WHEN i.exit_code <> 0 OR i.error <> '' THEN 'failed' ELSE 'succeeded' END,
                        finished_at = compute_now()
    FROM ins i
   WHERE c.id = i.command_id AND c.state IN ('pending', 'dispatched', 'acknowledged')
  RETURNING c.id
), a AS (
  SELECT * FROM unnest($12::int[], $13::text[], $14::text[]) AS a(i, node_id, command_id)
), acked AS (
  UPDATE commands c SET state = 'acknowledged', acked_at = compute_now()
    FROM a
   WHERE c.id = a.command_id AND c.node_id = a.node_id AND c.state = 'dispatched'
  RETURNING c.id
), e AS (
  SELECT * FROM unnest($15::int[], $16::text[], $17::text[], $18::text[], $19::text[], $20::timestamptz[], $21::bigint[], $22::bigint[])
    AS e(i, node_id, id, kind, payload, occurred_at, session_epoch, boot_epoch)
), evins AS (
  INSERT INTO node_events (node_id, id, kind, payload, occurred_at, gateway_id, session_epoch, boot_epoch)
  SELECT e.node_id, e.id, e.kind, e.payload::jsonb, e.occurred_at, $1, e.session_epoch, e.boot_epoch FROM e
  ON CONFLICT (node_id, id) DO NOTHING
  RETURNING node_id, id
), o AS (
  SELECT * FROM unnest($23::int[], $24::text[], $25::text[], $26::bigint[], $27::text[], $28::bytea[], $34::bool[])
    AS o(i, node_id, command_id, off, stream, data, trunc)
), own AS (
  SELECT o.* FROM o JOIN commands c ON c.id = o.command_id AND c.node_id = o.node_id
), oins AS (
  INSERT INTO command_output (command_id, "offset", stream, data)
  SELECT command_id, off, stream, substring(data FROM 1 FOR LEAST(length(data)::bigint, $29::bigint - off)::int)
    FROM own WHERE off < $29::bigint AND length(data) > 0
  ON CONFLICT (command_id, "offset") DO NOTHING
  RETURNING command_id
), omark AS (
  INSERT INTO command_output (command_id, "offset", stream, data)
  SELECT DISTINCT command_id, $29::bigint, 'truncated', ''::bytea FROM own WHERE trunc OR off + length(data) > $29::bigint
  ON CONFLICT (command_id, "offset") DO NOTHING
  RETURNING command_id
), k AS (
  SELECT * FROM unnest($30::int[], $31::text[], $32::text[], $33::text[]) AS k(i, node_id, command_id, outcome)
), kupd AS (
  UPDATE commands c SET cancel_confirmed_at = compute_now(), cancel_outcome = k.outcome
    FROM k
   WHERE c.id = k.command_id AND c.node_id = k.node_id
     AND c.cancel_requested_at IS NOT NULL AND c.cancel_confirmed_at IS NULL
  RETURNING c.id
)
SELECT r.i, CASE WHEN c.id IS NULL THEN 'unknown'
                 WHEN c.node_id <> r.node_id THEN 'denied'
                 WHEN EXISTS (SELECT 1 FROM ins WHERE ins.node_id = r.node_id AND ins.id = r.id) THEN 'stored'
                 WHEN EXISTS (SELECT 1 FROM command_results x WHERE x.node_id = r.node_id AND x.id = r.id) THEN 'duplicate'
                 ELSE 'ignored' END,
       CASE WHEN c.node_id = r.node_id THEN c.traceparent END
  FROM r LEFT JOIN commands c ON c.id = r.command_id
UNION ALL
SELECT a.i, CASE WHEN c.node_id IS NOT NULL AND c.node_id <> a.node_id THEN 'denied' ELSE 'ok' END, NULL::text
  FROM a LEFT JOIN commands c ON c.id = a.command_id
UNION ALL
SELECT e.i, CASE WHEN EXISTS (SELECT 1 FROM evins x WHERE x.node_id = e.node_id AND x.id = e.id) THEN 'stored' ELSE 'duplicate' END, NULL::text
  FROM e
UNION ALL
SELECT o.i, CASE WHEN c.id IS NULL THEN 'unknown'
                 WHEN c.node_id <> o.node_id THEN 'denied'
                 WHEN o.off + length(o.data) > $29::bigint THEN 'capped'
                 ELSE 'ok' END, NULL::text
  FROM o LEFT JOIN commands c ON c.id = o.command_id
UNION ALL
SELECT k.i, CASE WHEN c.node_id IS NOT NULL AND c.node_id <> k.node_id THEN 'denied' ELSE 'ok' END, NULL::text
  FROM k LEFT JOIN commands c ON c.id = k.command_id
UNION ALL
SELECT -1, 'notified', NULL::text FROM (SELECT pg_notify('` + pgnotify.CommandDone + `', '') FROM (SELECT 1 FROM fin LIMIT 1) f) n
UNION ALL
SELECT -1, 'notified', NULL::text FROM (
  SELECT pg_notify('` + pgnotify.CommandOutput + `',
                   CASE WHEN sum(length(z.command_id) + 1) <= 7900 THEN string_agg(z.command_id, ',') ELSE '' END)
    FROM (SELECT command_id FROM oins UNION SELECT command_id FROM omark) z
  HAVING count(*) > 0) n2`
