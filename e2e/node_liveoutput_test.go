package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/fleettest"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

// liveCap is the gateway's --gateway.output-cap in TestLiveOutputPastTheStoredCap.
const liveCap = 64 << 10

// TestLiveOutputPastTheStoredCap runs real processes: a gateway that
// stores the first liveCap bytes of a command's output and relays the
// rest, the api with the relay token, and a leasehold-node with its
// default --output.max-bytes.
//
//   - A reader opened right after the create gets the whole output of
//     `seq 1 2500000` (18.9 MB), byte-exact and without a truncation
//     marker, while command_output holds only the stored part and the
//     marker.
//   - A reader that comes after the command finished gets the stored part,
//     the part the gateway kept for late readers (at most 8 MiB), and the
//     truncation marker where that ends.
//   - A reader that comes after a quick command (1.3 MB) finished gets all
//     of it.
//   - A reader that joins while the command is past what was kept and
//     silent gets the stored and kept parts, then the truncation marker
//     when the next live piece shows it missed bytes, never a piece out of
//     place.
func TestLiveOutputPastTheStoredCap(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ids, creds := fleettest.RegisterNodes(t, db.Pool, "live", 1)
	gw, api := startRelayedPlane(t, db, "live", "operator", agentOperatorToken, "--gateway.output-cap", strconv.Itoa(liveCap))
	s := &agentStack{db: db, lb: gw.Listen, root: t.TempDir(), api: api}
	state := filepath.Join(s.root, ids[0])
	require.NoError(t, os.MkdirAll(state, 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(state, "credential"), []byte(creds[0]+"\n"), 0o600))
	proctest.Start(t, ids[0], fleettest.Binary(t, "node"), nil, "--gateway-url", "http://"+gw.Listen, "--state-dir", state,
		"--node-id", ids[0], "--http-addr", fleettest.Addr(t), "--log-format", "text").WaitReady(60 * time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	const lines = 2500000
	var want bytes.Buffer
	for i := 1; i <= lines; i++ {
		want.WriteString(strconv.Itoa(i))
		want.WriteByte('\n')
	}
	id := s.create(ctx, t, ids[0], "exec", &nodev1.ExecPayload{Argv: []string{"seq", "1", strconv.Itoa(lines)}})

	t.Run("a live reader gets the whole output", func(t *testing.T) {
		got, marker, err := readOutput(ctx, s.api, id, 0, nil)
		require.NoError(t, err)
		require.Equal(t, int64(-1), marker, "no truncation marker for a reader that kept up")
		require.Equal(t, want.Len(), len(got))
		require.True(t, bytes.Equal(want.Bytes(), got), "the output differs from seq's")
		w := s.wait(ctx, t, id)
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_SUCCEEDED, w.GetCommand().GetState())

		var rows, stored, markerAt int64
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE stream <> 'truncated'), coalesce(sum(length(data)), 0),
		  coalesce(max("offset") FILTER (WHERE stream = 'truncated'), -1) FROM command_output WHERE command_id = $1`, id).Scan(&rows, &stored, &markerAt))
		require.Equal(t, int64(liveCap), stored, "PostgreSQL keeps the first --gateway.output-cap bytes (%d rows)", rows)
		require.Equal(t, int64(liveCap), markerAt, "and the truncation marker at the cap")
	})

	t.Run("a reader after the end gets the stored part, what the gateway kept, and the marker", func(t *testing.T) {
		got, marker, err := readOutput(ctx, s.api, id, 0, nil)
		require.NoError(t, err)
		require.Greater(t, marker, int64(liveCap), "the gateway kept bytes past the cap for late readers")
		require.LessOrEqual(t, marker, int64(liveCap+8<<20), "at most 8 MiB of them")
		require.True(t, bytes.Equal(want.Bytes()[:marker], got))
	})

	t.Run("a reader after a quick command's end gets it whole", func(t *testing.T) {
		// What `leasehold run` does: it learns the command's id from the
		// run, often after the command has finished.
		id := s.create(ctx, t, ids[0], "exec", &nodev1.ExecPayload{Argv: []string{"seq", "1", "200000"}})
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_SUCCEEDED, s.wait(ctx, t, id).GetCommand().GetState())
		got, marker, err := readOutput(ctx, s.api, id, 0, nil)
		require.NoError(t, err)
		require.Equal(t, int64(-1), marker)
		require.True(t, bytes.Equal(want.Bytes()[:len(got)], got))
		require.Equal(t, 1288895, len(got), "seq 1 200000 prints 1,288,895 bytes")
	})

	t.Run("a reader that missed live bytes gets the marker where they start", func(t *testing.T) {
		// 1,500,000 lines (10.4 MB: more than the cap and what the gateway
		// keeps) pass before any reader comes, then one more line after the
		// reader has joined.
		dir := t.TempDir()
		printed, next := filepath.Join(dir, "printed"), filepath.Join(dir, "next")
		script := fmt.Sprintf("seq 1 1500000; touch %s; while [ ! -e %s ]; do sleep 0.05; done; echo late", printed, next)
		id := s.create(ctx, t, ids[0], "exec", &nodev1.ExecPayload{Argv: []string{"sh", "-c", script}})
		require.Eventually(t, func() bool {
			_, err := os.Stat(printed)
			return err == nil
		}, 60*time.Second, 20*time.Millisecond, "seq printed its lines")
		type read struct {
			got    []byte
			marker int64
			err    error
		}
		done := make(chan read, 1)
		go func() {
			got, marker, err := readOutput(ctx, s.api, id, 0, nil)
			done <- read{got, marker, err}
		}()
		// Once the api watches the gateway (the reader waits past the
		// stored part) the next line comes, and shows the reader the bytes
		// it missed. A piece of seq's still in flight when the watch began
		// shows it as well, and ends the reader sooner, with the same
		// marker.
		var r read
		require.Eventually(t, func() bool {
			select {
			case r = <-done:
				return true
			default:
				return metricValue(t, gw, "leasehold_gateway_output_watchers") == 1
			}
		}, 60*time.Second, 20*time.Millisecond, "the api watches the gateway")
		require.NoError(t, os.WriteFile(next, nil, 0o600))
		if r.got == nil && r.err == nil {
			r = <-done
		}
		require.NoError(t, r.err)
		require.Greater(t, r.marker, int64(liveCap))
		require.LessOrEqual(t, r.marker, int64(liveCap+8<<20))
		require.True(t, bytes.Equal(want.Bytes()[:r.marker], r.got))
	})
}
