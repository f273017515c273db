package api

// Live output past the stored cap (docs/api.md, "StreamCommandOutput"). The
// database keeps the first --gateway.output-cap bytes of a command's output
// and a truncation marker; the rest crosses the gateway that holds the
// node's session and is not stored. A reader that follows a running command
// gets it from there: before its first read of the database the api opens
// WatchOutput on that gateway's relay listener (as tunnels do), and when
// the stored output ends at the marker it goes on with the pieces the
// gateway relays, from the marker's offset. Bytes the reader cannot get (it
// joined after they passed, or fell too far behind) end the stream with a
// truncation marker at the first missing byte, as before.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/pkg/coord"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	relayv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/relay/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/relay/v1/relayv1connect"
)

const (
	// liveOpenTimeout bounds the wait for a gateway's first WatchOutput
	// response; without it the reader goes on with stored output alone.
	liveOpenTimeout = 3 * time.Second
	// liveRetry spaces the attempts to open a watch for one reader.
	liveRetry = time.Second
	// liveSettle is how long a finished command's watch may stay silent
	// before the reader stops waiting for the gateway's end.
	liveSettle = 5 * time.Second
	// liveLateSettle is how long a watch opened after the command finished
	// may stay silent.
	liveLateSettle = time.Second
	// livePieces is how many relayed pieces wait for the reader in the api
	// (more wait in HTTP/2 windows and the gateway's queue).
	livePieces = 16
)

// liveRouteSQL finds whether a command may still produce output and the
// relay of the gateway that holds its node's session.
var liveRouteSQL = `
SELECT c.node_id, c.state IN ('pending', 'dispatched', 'acknowledged'), coalesce(r.relay_addr, '')
  FROM commands c
  LEFT JOIN node_sessions s ON s.node_id = c.node_id AND s.state = 'connected' AND s.session_expires_at > compute_now()
       AND ` + coord.GatewayLeaseLive("s.gateway_id") + `
  LEFT JOIN gateway_relays r ON r.gateway_id = s.gateway_id
 WHERE c.id = $1`

// markerSQL is the offset of a command's truncation marker.
const markerSQL = `SELECT "offset" FROM command_output WHERE command_id = $1 AND stream = 'truncated'`

// liveOutput is one WatchOutput call: pieces in order, closed at the end
// (err nil after the gateway's end message, else why it broke).
type liveOutput struct {
	cancel context.CancelFunc
	pieces chan *relayv1.WatchOutputResponse
	err    error
}

// watchLive opens WatchOutput for command id on the gateway that holds its
// node's session and waits for the gateway to confirm it relays. It
// returns nil (the reader goes on with stored output alone) when the api
// has no relay, the command is finished (unless finished is allowed: a
// late reader, for what the gateway kept), its node has no live session on
// a gateway with a relay, or the gateway does not confirm.
func (h *Handler) watchLive(ctx context.Context, id string, finished bool) *liveOutput {
	if h.relay == nil {
		return nil
	}
	var (
		node, addr string
		running    bool
	)
	if err := h.db.QueryRow(ctx, liveRouteSQL, id).Scan(&node, &running, &addr); err != nil || (!running && !finished) || addr == "" {
		if err != nil && !errors.Is(err, pgx.ErrNoRows) && ctx.Err() == nil {
			h.log.Debug("live output route not read", "command", id, "err", err)
		}
		return nil
	}
	wctx, cancel := context.WithCancel(ctx)
	client := relayv1connect.NewGatewayRelayServiceClient(h.relay.client, h.relay.scheme+"://"+addr,
		connect.WithReadMaxBytes(outputPieceMax+4096),
		connect.WithAcceptCompression("gzip", nil, nil)) // output as it is: no gzip per message
	req := connect.NewRequest(&relayv1.WatchOutputRequest{NodeId: node, CommandId: id})
	if h.relay.token != nil {
		req.Header().Set("Authorization", "Bearer "+h.relay.token.Value())
	}
	l := &liveOutput{cancel: cancel, pieces: make(chan *relayv1.WatchOutputResponse, livePieces)}
	watching := make(chan struct{})
	go func() {
		defer close(l.pieces)
		st, err := client.WatchOutput(wctx, req)
		if err != nil {
			l.err = err
			return
		}
		defer func() { _ = st.Close() }()
		first := true
		for st.Receive() {
			if first {
				first = false
				if !st.Msg().GetWatching() {
					l.err = fmt.Errorf("gateway at %s answered WatchOutput without watching", addr)
					return
				}
				close(watching)
				continue
			}
			select {
			case l.pieces <- st.Msg():
			case <-wctx.Done():
				l.err = wctx.Err()
				return
			}
		}
		l.err = st.Err()
		if l.err == nil && first {
			l.err = fmt.Errorf("gateway at %s ended WatchOutput before watching", addr)
		}
	}()
	t := time.NewTimer(liveOpenTimeout)
	defer t.Stop()
	select {
	case <-watching:
		return l
	case <-l.pieces: // closed before watching: l.err says why
		h.log.Info("live output not relayed", "command", id, "gateway", addr, "err", l.err)
	case <-t.C:
		h.log.Info("live output not relayed", "command", id, "gateway", addr, "err", "no answer within "+liveOpenTimeout.String())
	case <-ctx.Done():
	}
	cancel()
	return nil
}

// followLive sends the relayed output of id from offset, where its stored
// output ended at the truncation marker, until the gateway says it ended.
// A missing byte (the watch began after it passed, or fell behind) ends
// the stream with a truncation marker there; a broken watch ends it
// UNAVAILABLE naming the offset to resume from.
func (h *Handler) followLive(ctx context.Context, stream *connect.ServerStream[controlv1.StreamCommandOutputResponse], id string, offset int64,
	l *liveOutput, wake <-chan struct{}, poll, limit <-chan time.Time, done bool) error {
	truncate := func() error {
		return stream.Send(&controlv1.StreamCommandOutputResponse{Offset: offset, Truncated: true})
	}
	var settle <-chan time.Time // set once the command is finished
	if done {
		// Finished before the watch: the gateway answers at once with what
		// it kept and the end, or knows nothing of the command.
		settle = time.After(liveLateSettle)
	}
	for {
		select {
		case m, ok := <-l.pieces:
			if !ok {
				if connect.CodeOf(l.err) == connect.CodeResourceExhausted {
					return truncate() // this reader fell behind the node
				}
				return connect.NewError(connect.CodeUnavailable, fmt.Errorf("live output relay ended; resume from offset %d: %w", offset, l.err))
			}
			if m.GetEnd() {
				if m.GetOffset() > offset {
					return truncate()
				}
				return nil
			}
			off, data := m.GetOffset(), m.GetData()
			if off+int64(len(data)) <= offset {
				continue // stored, or sent already
			}
			if off > offset {
				return truncate()
			}
			data = data[offset-off:]
			if err := stream.Send(&controlv1.StreamCommandOutputResponse{Offset: offset, Stream: m.GetStream(), Data: data}); err != nil {
				return err
			}
			offset += int64(len(data))
			if settle != nil {
				settle = time.After(liveSettle)
			}
		case <-wake:
			settle = h.settleIfDone(ctx, id, settle)
		case <-poll:
			settle = h.settleIfDone(ctx, id, settle)
		case <-settle:
			return truncate()
		case <-ctx.Done():
			return h.fail(ctx, "stream command output", ctx.Err())
		case <-h.waiter.stopping():
			return connect.NewError(connect.CodeUnavailable, fmt.Errorf("server stopping; resume from offset %d", offset))
		case <-limit:
			return connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("stream open for %s; resume from offset %d", maxStreamDuration, offset))
		}
	}
}

// settleIfDone starts the settle wait once id is finished (its result
// stored: the gateway has relayed everything or will end the watch).
func (h *Handler) settleIfDone(ctx context.Context, id string, settle <-chan time.Time) <-chan time.Time {
	if settle != nil {
		return settle
	}
	var done bool
	if err := h.db.QueryRow(ctx, outputDoneSQL, id, outputUnconfirmedGrace.Seconds()).Scan(&done); err != nil || !done {
		return nil
	}
	return time.After(liveSettle)
}

// pastMarker says whether id's stored output ended at a truncation marker
// at or before offset (a reader resuming past the stored part).
func (h *Handler) pastMarker(ctx context.Context, id string, offset int64) (bool, error) {
	var at int64
	err := h.db.QueryRow(ctx, markerSQL, id).Scan(&at)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return at <= offset, nil
}
