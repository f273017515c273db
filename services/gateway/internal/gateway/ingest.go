package gateway

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jonboulle/clockwork"
	"github.com/prometheus/client_golang/prometheus"
)

// Group commit of what nodes report. Results, acks and events of
// every session go into one queue; one goroutine writes everything queued in
// one statement (one transaction), so while a write is in flight the next
// batch gathers: the batch window is the previous write's duration, but at
// least --gateway.commit-spacing, and the batch is capped at
// maxIngestBatch. After a quiet spell a report is written at once; at a
// moderate rate the spacing gathers what a few milliseconds bring; under
// load the cost per report falls with the batch.
//
// The rules are those of the inline writes they replace: results and events
// are facts, accepted from any epoch (not fenced on the gateway lease) and
// deduplicated by (node_id, id); a node reports only for its own commands;
// a result closes its command only if it is not terminal yet.
//
// An event is answered only once it is committed: the session's read loop
// waits for its outcome, so a stream ends UNAVAILABLE (and the node resends
// after redialling) if the write fails. A result is not waited for but has
// the same ending: its outcome, on the ingest goroutine, closes the session
// if the write failed; the session's report budget bounds how many of its
// results are queued, and a Heartbeat is answered only once they are
// settled (handler.go). An ack is not waited for (see docs/decisions.md, "Throughput"): it only moves dispatched to
// acknowledged, which replay treats alike, so losing one loses nothing; a
// refused ack still closes the session PERMISSION_DENIED.
//
// Live output pieces (output.go) and cancel acks (cancel.go) ride the same
// queue and statement and, like acks, are not waited for.

// maxIngestBatch caps the reports written per transaction.
const maxIngestBatch = 1000

type ingestKind uint8

const (
	ingestAck ingestKind = iota
	ingestResult
	ingestEvent
	ingestOutput    // a piece of live output (output.go)
	ingestCancelAck // a node's answer to CancelCommand (cancel.go)
)

// ingestItem is one report waiting for the group commit.
type ingestItem struct {
	kind    ingestKind
	queued  time.Time // when submit queued it (gateway clock)
	s       *session
	id      string // result or event id; command id of an ack
	command string // result: its command id
	// result
	exitCode          int32
	output            []byte
	errText           string
	started, finished *time.Time
	// event
	eventKind string
	payload   string
	occurred  *time.Time
	bootEpoch int64
	// output piece (command is its command id); cancel ack (id is the
	// command id, stream the outcome's name)
	offset    int64
	stream    string
	truncated bool // the piece reaches the cap: store the truncation marker

	done chan ingestOutcome // events: their read loop waits on it
	// onDone, for results, is called with the outcome on the ingest
	// goroutine; it must not block.
	onDone func(ingestOutcome)
}

// ingestOutcome is what the group commit did with an item: stored,
// duplicate, unknown or denied; err when the write failed.
type ingestOutcome struct {
	outcome string
	err     error
	// traceparent is the stored CreateCommand traceparent of a result's
	// command, for the result span (tracing.go).
	traceparent *string
	// refusal, with outcome "refused", says why the database refused a
	// result for good (its command was failed instead).
	refusal string
}

// ingester is the queue in front of the group commit.
type ingester struct {
	clock   clockwork.Clock
	mu      sync.Mutex
	queue   []*ingestItem
	wake    chan struct{}
	stopped chan struct{}
}

func newIngester(clock clockwork.Clock) *ingester {
	return &ingester{clock: clock, wake: make(chan struct{}, 1), stopped: make(chan struct{})}
}

func (in *ingester) submit(it *ingestItem) {
	it.queued = in.clock.Now()
	in.mu.Lock()
	in.queue = append(in.queue, it)
	in.mu.Unlock()
	select {
	case in.wake <- struct{}{}:
	default:
	}
}

// maxIngestOutputBytes bounds the live output bytes of one group commit:
// a batch is cut after the piece that reaches it, so a statement carries a
// few MiB of output however much is queued.
const maxIngestOutputBytes = 4 << 20

func (in *ingester) take() []*ingestItem {
	in.mu.Lock()
	defer in.mu.Unlock()
	n, bytes := 0, 0
	for n < len(in.queue) && n < maxIngestBatch && bytes < maxIngestOutputBytes {
		bytes += len(in.queue[n].output)
		n++
	}
	out := in.queue[:n:n]
	in.queue = in.queue[n:]
	if len(in.queue) == 0 {
		in.queue = nil
	}
	return out
}

// empty says nothing waits for the group commit.
func (in *ingester) empty() bool {
	in.mu.Lock()
	defer in.mu.Unlock()
	return len(in.queue) == 0
}

// oldest is how long the first queued item has waited for the group
// commit (0 when nothing waits).
func (in *ingester) oldest() time.Duration {
	in.mu.Lock()
	defer in.mu.Unlock()
	if len(in.queue) == 0 {
		return 0
	}
	return in.clock.Since(in.queue[0].queued)
}

// await waits for it's outcome; the gateway stopping answers UNAVAILABLE.
func (g *Gateway) await(ctx context.Context, it *ingestItem, op string) (string, *connect.Error) {
	o, cerr := g.awaitOutcome(ctx, it, op)
	return o.outcome, cerr
}

// awaitOutcome is await with the whole outcome (its traceparent).
func (g *Gateway) awaitOutcome(ctx context.Context, it *ingestItem, op string) (ingestOutcome, *connect.Error) {
	g.ingest.submit(it)
	select {
	case o := <-it.done:
		if o.err != nil {
			return o, dbError(op, o.err)
		}
		return o, nil
	case <-ctx.Done():
		return ingestOutcome{err: ctx.Err()}, connect.NewError(connect.CodeCanceled, ctx.Err())
	case <-g.ingest.stopped:
		err := fmt.Errorf("gateway %s is stopping; reconnect and resend", g.id)
		return ingestOutcome{err: err}, connect.NewError(connect.CodeUnavailable, err)
	}
}

// ingestLoop writes the queued reports until ctx ends, then fails what is
// left. Two writes start at least --gateway.commit-spacing apart: what
// arrives meanwhile shares the next one.
func (g *Gateway) ingestLoop(ctx context.Context) {
	defer close(g.ingest.stopped)
	var lastStart time.Time
	for {
		select {
		case <-ctx.Done():
			for _, it := range g.ingest.take() {
				g.answer(it, ingestOutcome{err: ctx.Err()})
			}
			return
		case <-g.ingest.wake:
		}
		for !g.ingest.empty() {
			// Writes start at least CommitSpacing apart (a fake clock
			// in a test holds the second one until it is advanced, so
			// such a test sets the spacing to 0).
			if wait := g.cfg.CommitSpacing - g.clock.Since(lastStart); !lastStart.IsZero() && wait > 0 {
				t := g.clock.NewTimer(wait)
				select {
				case <-ctx.Done():
				case <-t.Chan():
				}
				t.Stop()
			}
			lastStart = g.clock.Now()
			g.flush(ctx, g.ingest.take()) // the only taker: what was queued is still there
		}
	}
}

func (g *Gateway) answer(it *ingestItem, o ingestOutcome) {
	if it.onDone != nil {
		it.onDone(o)
		return
	}
	if it.done != nil {
		it.done <- o
		return
	}
	// An ack, output piece or cancel ack: nobody waits.
	if it.kind == ingestOutput || it.kind == ingestCancelAck {
		g.answerUnwaited(it, o)
		return
	}
	switch {
	case o.err != nil:
		if !errors.Is(o.err, context.Canceled) {
			g.log.Warn("command ack not recorded; replay treats the command alike", "node", it.s.nodeID, "command", it.id, "err", o.err)
		}
	case o.outcome == "denied":
		it.s.close(connect.NewError(connect.CodePermissionDenied, fmt.Errorf("command %s belongs to another node", it.id)))
	}
}

// flush writes batch in one statement. If the statement fails for a
// reason other than the connection, each item is written alone, so one bad
// item cannot fail the others.
func (g *Gateway) flush(ctx context.Context, batch []*ingestItem) {
	if batch, later := splitRowConflicts(batch); len(later) > 0 {
		g.flush(ctx, batch)
		g.flush(ctx, later)
		return
	}
	timer := prometheus.NewTimer(g.m.ingestFlush) // wall time: a latency metric
	out, tps, err := g.writeBatch(ctx, batch)
	for attempt := 1; err != nil && lockConflict(err) && attempt < maxConflictRetries && ctx.Err() == nil; attempt++ {
		// A deadlock (a Hello's replay locking the same commands in
		// another order) or a serialization failure says nothing about
		// the reports: the batch is written again whole. Splitting it
		// into one statement per report, as for an error that may be one
		// report's, would cost a thousand round trips at the moment the
		// database is busiest.
		g.m.ingestRetries.Inc()
		g.log.Info("group commit hit a lock conflict; writing the batch again", "reports", len(batch), "attempt", attempt, "err", err)
		out, tps, err = g.writeBatch(ctx, batch)
	}
	if err != nil && len(batch) > 1 && ctx.Err() == nil {
		g.log.Warn("group commit failed; writing its reports one by one", "reports", len(batch), "err", err)
		for _, it := range batch {
			g.flush(ctx, []*ingestItem{it})
		}
		return
	}
	if err != nil && len(batch) == 1 && batch[0].kind == ingestResult && permanentDBError(err) {
		// Resending it would be refused again, forever: its command
		// fails instead, with the reason, so nothing replays it.
		it := batch[0]
		refusal := fmt.Sprintf("the result the node sent (result_id %q) could not be stored: %s", it.id, pgMessage(err))
		if ferr := g.failRefusedResult(ctx, it, refusal); ferr != nil {
			g.answer(it, ingestOutcome{err: ferr})
			return
		}
		g.log.Warn("result refused by the database; its command is failed", "node", it.s.nodeID, "command", it.command, "err", err)
		g.answer(it, ingestOutcome{outcome: "refused", refusal: refusal})
		return
	}
	g.m.ingestBatch.Observe(float64(len(batch)))
	timer.ObserveDuration()
	for i, it := range batch {
		if err != nil {
			g.answer(it, ingestOutcome{err: err})
			continue
		}
		g.answer(it, ingestOutcome{outcome: out[i], traceparent: tps[i]})
	}
}

// splitRowConflicts moves the cancel acks of commands that also have a
// result in batch to a batch of their own, written after it: a result is
// stored in its command's row, which a cancel ack changes too, and one
// statement must not change a row twice.
func splitRowConflicts(batch []*ingestItem) (first, later []*ingestItem) {
	resulted := map[string]bool{}
	for _, it := range batch {
		if it.kind == ingestResult {
			resulted[it.command] = true
		}
	}
	for _, it := range batch {
		if it.kind == ingestCancelAck && resulted[it.id] {
			later = append(later, it)
			continue
		}
		first = append(first, it)
	}
	if len(later) == 0 {
		return batch, nil
	}
	return first, later
}

// writeBatch runs ingestSQL for batch and returns each item's outcome.
func (g *Gateway) writeBatch(ctx context.Context, batch []*ingestItem) ([]string, []*string, error) {
	out := make([]string, len(batch))
	tps := make([]*string, len(batch))
	var (
		rI, aI, eI                  []int32
		rNode, rID, rCmd, rErr      []string
		rExit                       []int32
		rOut                        [][]byte
		rStart, rFin                []*time.Time
		rEpoch                      []int64
		aNode, aCmd                 []string
		eNode, eID, eKind, ePayload []string
		eOcc                        []*time.Time
		eEpoch, eBoot               []int64
		oI, kI                      []int32
		oNode, oCmd, oStream        []string
		oOff                        []int64
		oData                       [][]byte
		oTrunc                      []bool
		kNode, kCmd, kOutcome       []string
	)
	resulted := map[string]bool{}
	for _, it := range batch {
		if it.kind == ingestResult {
			resulted[it.command] = true
		}
	}
	type key struct{ node, id string }
	type okey struct {
		node, id string
		off      int64
	}
	seenR, seenE, seenA, seenK := map[key]bool{}, map[key]bool{}, map[key]bool{}, map[key]bool{}
	resultOf := map[string]bool{} // commands with a result in the batch: one result per command
	seenO := map[okey]bool{}
	for i, it := range batch {
		k := key{it.s.nodeID, it.id}
		switch it.kind {
		case ingestAck:
			// One statement must not change a row twice: an ack whose
			// command's result is in the batch is superseded by it.
			if resulted[it.id] || seenA[k] {
				out[i] = "superseded"
				continue
			}
			seenA[k] = true
			aI, aNode, aCmd = append(aI, int32(i)), append(aNode, it.s.nodeID), append(aCmd, it.id)
		case ingestResult:
			if seenR[k] {
				out[i] = "duplicate"
				continue
			}
			if resultOf[it.command] {
				out[i] = "ignored"
				continue
			}
			seenR[k], resultOf[it.command] = true, true
			rI, rNode, rID, rCmd = append(rI, int32(i)), append(rNode, it.s.nodeID), append(rID, it.id), append(rCmd, it.command)
			rExit, rOut, rErr = append(rExit, it.exitCode), append(rOut, it.output), append(rErr, it.errText)
			rStart, rFin, rEpoch = append(rStart, it.started), append(rFin, it.finished), append(rEpoch, it.s.epoch)
		case ingestEvent:
			if seenE[k] {
				out[i] = "duplicate"
				continue
			}
			seenE[k] = true
			eI, eNode, eID, eKind = append(eI, int32(i)), append(eNode, it.s.nodeID), append(eID, it.id), append(eKind, it.eventKind)
			ePayload, eOcc, eEpoch, eBoot = append(ePayload, it.payload), append(eOcc, it.occurred), append(eEpoch, it.s.epoch), append(eBoot, it.bootEpoch)
		case ingestOutput:
			ok := okey{it.s.nodeID, it.command, it.offset}
			if seenO[ok] {
				out[i] = "duplicate"
				continue
			}
			seenO[ok] = true
			oI, oNode, oCmd, oOff = append(oI, int32(i)), append(oNode, it.s.nodeID), append(oCmd, it.command), append(oOff, it.offset)
			oStream, oData, oTrunc = append(oStream, it.stream), append(oData, it.output), append(oTrunc, it.truncated)
		case ingestCancelAck:
			// A cancel ack changes a cancelled (terminal) command, which no
			// ack of the batch changes and no result either (flush writes
			// those separately); two acks of one command would, so the
			// second is dropped.
			if seenK[k] {
				out[i] = "duplicate"
				continue
			}
			seenK[k] = true
			kI, kNode, kCmd, kOutcome = append(kI, int32(i)), append(kNode, it.s.nodeID), append(kCmd, it.id), append(kOutcome, it.stream)
		}
	}
	args := []any{g.id,
		rI, rNode, rID, rCmd, rExit, rOut, rErr, rStart, rFin, rEpoch,
		aI, aNode, aCmd}
	stmt := ingestReportsSQL
	if len(eI)+len(oI)+len(kI) > 0 {
		stmt = ingestSQL
		args = append(args, eI, eNode, eID, eKind, ePayload, eOcc, eEpoch, eBoot,
			oI, oNode, oCmd, oOff, oStream, oData, g.cfg.OutputCap,
			kI, kNode, kCmd, kOutcome, oTrunc)
	}
	rows, err := g.db.Query(ctx, stmt, args...)
	if err != nil {
		return nil, nil, fmt.Errorf("group commit of %d reports: %w", len(batch), err)
	}
	defer rows.Close()
	for rows.Next() {
		var (
			i       int32
			outcome string
			tp      *string
		)
		if err := rows.Scan(&i, &outcome, &tp); err != nil {
			return nil, nil, fmt.Errorf("group commit: %w", err)
		}
		if i >= 0 && int(i) < len(out) {
			out[i], tps[i] = outcome, tp
		}
	}
	if err := rows.Err(); err != nil {
		return nil, nil, fmt.Errorf("group commit of %d reports: %w", len(batch), err)
	}
	return out, tps, nil
}

// permanentDBError says whether err is the database refusing a statement
// for a reason retrying cannot change: a data exception (SQLSTATE class
// 22, e.g. a NUL in text, a timestamp out of range) or an integrity
// violation (class 23) other than the conflicts a retry resolves (unique
// and foreign key violations: a concurrent writer or a deleted command).
// maxConflictRetries bounds the writes of one batch that lock conflicts
// may take before it is written one report at a time.
const maxConflictRetries = 3

// lockConflict reports whether err is a transaction the database aborted
// for a conflict with another one (deadlock_detected,
// serialization_failure): writing the same again is expected to succeed.
func lockConflict(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && (pe.Code == "40P01" || pe.Code == "40001")
}

func permanentDBError(err error) bool {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || len(pe.Code) != 5 {
		return false
	}
	switch pe.Code[:2] {
	case "22":
		return true
	case "23":
		return pe.Code != "23505" && pe.Code != "23503" // unique_violation, foreign_key_violation
	}
	return false
}

// pgMessage is the database's reason for err, as text the database
// stores: "SQLSTATE <code>: <message>".
func pgMessage(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return sanitizeText(fmt.Sprintf("SQLSTATE %s: %s", pe.Code, pe.Message))
	}
	return sanitizeText(err.Error())
}

// failRefusedResult fails it's command (a result the database refused for
// good) with refusal as its result, in a transaction fenced on the gateway
// lease, only for the result's own node and while the command is not
// terminal.
func (g *Gateway) failRefusedResult(ctx context.Context, it *ingestItem, refusal string) error {
	err := g.runFenced(ctx, func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, failRefusedResultSQL, it.s.nodeID, it.command, refusal, g.id, it.s.epoch)
		return err
	})
	if err != nil {
		return fmt.Errorf("fail command %s after its result was refused: %w", it.command, err)
	}
	return nil
}

// sanitizeText makes s storable as PostgreSQL text: invalid UTF-8 and NUL
// bytes become U+FFFD.
func sanitizeText(s string) string {
	if utf8.ValidString(s) && !strings.ContainsRune(s, 0) {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}
