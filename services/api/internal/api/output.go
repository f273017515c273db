package api

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// Live command output (docs/api.md, "StreamCommandOutput"). The database is
// the source of truth: a reader sends what command_output holds from its
// offset, then waits for a wake-up and reads again. Gateways NOTIFY
// leasehold_command_output once per group commit with the ids of the
// commands that got output (never the output: the 8,000-byte payload limit
// is never reached), and leasehold_command_done when commands finish; the
// waiter's LISTEN connection wakes the readers of the named commands (all
// of them for "" or a finished command). The wait-poll interval is the
// fallback when notifications are off or lost. So a reader on any api
// replica, or one that reconnects with the offset after the last byte it
// got, gets the whole stored output.

const (
	// outputPage bounds the rows read per query.
	outputPage = 64
	// outputPieceMax is the gateway's largest stored piece: a piece that
	// holds the offset starts at most this far before it, which keeps the
	// read a range scan of the primary key.
	outputPieceMax = 256 << 10
	// outputUnconfirmedGrace is how long after its cancellation the stream
	// of a cancelled command whose node has neither answered nor sent a
	// result stays open for more output.
	outputUnconfirmedGrace = 30 * time.Second
	// maxStreamDuration bounds one StreamCommandOutput call below the
	// server's write timeout; the caller resumes from its offset.
	maxStreamDuration = MaxWait
)

// outputChunksSQL reads the stored pieces that end after $2 (and a
// truncation marker at or after it), in order.
const outputChunksSQL = `
SELECT "offset", stream, data FROM command_output
 WHERE command_id = $1 AND "offset" >= $2::bigint - $4::bigint
   AND ("offset" + length(data) > $2::bigint OR (stream = 'truncated' AND "offset" >= $2::bigint))
 ORDER BY "offset" LIMIT $3`

// outputDoneSQL says whether no more output can come for the command: it
// is terminal and either never reached its node, expired, has a result,
// had its cancellation confirmed, or was cancelled longer ago than the
// grace ($2 seconds) without an answer.
const outputDoneSQL = `
SELECT c.state IN ('succeeded', 'failed', 'cancelled', 'expired')
   AND (c.dispatch_count = 0 OR c.state = 'expired' OR c.cancel_confirmed_at IS NOT NULL
        OR c.result_id IS NOT NULL OR EXISTS (SELECT 1 FROM command_results r WHERE r.command_id = c.id)
        OR c.finished_at < compute_now() - make_interval(secs => $2::float8))
  FROM commands c WHERE c.id = $1`

var outputStreamNames = map[string]nodev1.OutputStream{
	"stdout": nodev1.OutputStream_OUTPUT_STREAM_STDOUT,
	"stderr": nodev1.OutputStream_OUTPUT_STREAM_STDERR,
}

// StreamCommandOutput sends the command's output from req.offset, follows
// it live, and ends when the command is finished and everything stored was
// sent, or after a truncation marker. A call lasts at most MaxWait: it then
// ends DEADLINE_EXCEEDED, naming the offset to resume from.
func (h *Handler) StreamCommandOutput(ctx context.Context, req *connect.Request[controlv1.StreamCommandOutputRequest], stream *connect.ServerStream[controlv1.StreamCommandOutputResponse]) error {
	id, offset := req.Msg.GetCommandId(), req.Msg.GetOffset()
	if err := checkRE("command_id", id, idRE); err != nil {
		return err
	}
	if offset < 0 {
		return invalid("offset", "must not be negative, got %d", offset)
	}
	// Subscribe before the first read, so no wake-up falls between them.
	wake, unsubscribe := h.waiter.output.subscribe(id)
	defer unsubscribe()
	poll := time.NewTicker(h.waiter.interval)
	defer poll.Stop()
	limit := time.NewTimer(maxStreamDuration)
	defer limit.Stop()
	var (
		live     *liveOutput // outputlive.go
		liveNext time.Time
	)
	defer func() {
		if live != nil {
			live.cancel()
		}
	}()
	for {
		var done bool
		err := h.db.QueryRow(ctx, outputDoneSQL, id, outputUnconfirmedGrace.Seconds()).Scan(&done)
		if errors.Is(err, pgx.ErrNoRows) {
			return notFound("command_id", "command", id)
		}
		if err != nil {
			return h.fail(ctx, "stream command output", err)
		}
		// Watch before reading, so no relayed piece falls between the
		// stored output and the live one.
		if live == nil && !done && h.relay != nil && !time.Now().Before(liveNext) {
			live, liveNext = h.watchLive(ctx, id, false), time.Now().Add(liveRetry)
		}
		sent, marker, next, err := h.sendOutput(ctx, stream, id, offset)
		if err != nil {
			return err
		}
		offset = next
		if marker >= 0 { // the stored output ends here
			if live == nil && h.relay != nil {
				// A reader that came late, even after the end: the gateway
				// may still hold what passed (it keeps some for late watchers).
				live = h.watchLive(ctx, id, true)
			}
			if live == nil {
				return stream.Send(&controlv1.StreamCommandOutputResponse{Offset: marker, Truncated: true})
			}
			return h.followLive(ctx, stream, id, offset, live, wake, poll.C, limit.C, done)
		}
		if done && sent == 0 {
			return nil
		}
		if sent == 0 && live != nil && offset > 0 {
			past, err := h.pastMarker(ctx, id, offset)
			if err != nil {
				return h.fail(ctx, "stream command output", err)
			}
			if past {
				return h.followLive(ctx, stream, id, offset, live, wake, poll.C, limit.C, done)
			}
		}
		if sent == outputPage {
			continue // more is stored
		}
		if done {
			continue // one more read: output committed with the result
		}
		select {
		case <-ctx.Done():
			return h.fail(ctx, "stream command output", ctx.Err())
		case <-h.waiter.stopping():
			return connect.NewError(connect.CodeUnavailable, fmt.Errorf("server stopping; resume from offset %d", offset))
		case <-limit.C:
			return connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("stream open for %s; resume from offset %d", maxStreamDuration, offset))
		case <-wake:
		case <-poll.C:
		}
	}
}

// sendOutput sends one page of stored output from offset and returns how
// many rows it read, the offset of the truncation marker when it reached
// it (-1 otherwise; the caller sends it, or follows the relayed output),
// and the offset after what it sent.
func (h *Handler) sendOutput(ctx context.Context, stream *connect.ServerStream[controlv1.StreamCommandOutputResponse], id string, offset int64) (int, int64, int64, error) {
	rows, err := h.db.Query(ctx, outputChunksSQL, id, offset, outputPage, outputPieceMax)
	if err != nil {
		return 0, -1, offset, h.fail(ctx, "stream command output", err)
	}
	type piece struct {
		off    int64
		stream string
		data   []byte
	}
	pieces, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (piece, error) {
		var p piece
		return p, r.Scan(&p.off, &p.stream, &p.data)
	})
	if err != nil {
		return 0, -1, offset, h.fail(ctx, "stream command output", err)
	}
	for _, p := range pieces {
		if p.stream == "truncated" {
			return len(pieces), p.off, offset, nil
		}
		data := p.data
		if p.off < offset { // the piece holding the offset: send its rest
			data = data[offset-p.off:]
			p.off = offset
		}
		if err := stream.Send(&controlv1.StreamCommandOutputResponse{Offset: p.off, Stream: outputStreamNames[p.stream], Data: data}); err != nil {
			return 0, -1, offset, err
		}
		offset = p.off + int64(len(data))
	}
	return len(pieces), -1, offset, nil
}

// outputHub wakes StreamCommandOutput readers by command id.
type outputHub struct {
	mu      sync.Mutex
	readers map[string]map[chan struct{}]struct{}
}

func newOutputHub() *outputHub {
	return &outputHub{readers: map[string]map[chan struct{}]struct{}{}}
}

// subscribe returns a channel (capacity 1) signalled when id may have new
// output or have finished, and a function that unsubscribes.
func (o *outputHub) subscribe(id string) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	o.mu.Lock()
	set := o.readers[id]
	if set == nil {
		set = map[chan struct{}]struct{}{}
		o.readers[id] = set
	}
	set[ch] = struct{}{}
	o.mu.Unlock()
	return ch, func() {
		o.mu.Lock()
		defer o.mu.Unlock()
		// A set is removed only once empty, so ch is in the current one.
		cur := o.readers[id]
		delete(cur, ch)
		if len(cur) == 0 {
			delete(o.readers, id)
		}
	}
}

// wake signals the readers of the comma-separated command ids in payload,
// or every reader for "".
func (o *outputHub) wake(payload string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	signal := func(set map[chan struct{}]struct{}) {
		for ch := range set {
			select {
			case ch <- struct{}{}:
			default:
			}
		}
	}
	if payload == "" {
		for _, set := range o.readers {
			signal(set)
		}
		return
	}
	for _, id := range strings.Split(payload, ",") {
		signal(o.readers[id])
	}
}
