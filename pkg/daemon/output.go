package daemon

import (
	"context"
	"io"
	"sync"
	"time"

	"github.com/jonboulle/clockwork"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// Live output (docs/gateway.md, "Live output"). A Handler that wants its
// output seen while it runs writes to Stdout(ctx) and Stderr(ctx); the
// daemon sends what is written as CommandOutput messages, each tagged with
// its byte offset in the command's output (both streams together), so the
// gateway stores a re-sent piece once. Writes are coalesced: a piece is sent
// when it reaches outputPieceBytes, when the other stream is written, after
// Config.OutputFlush, and when the handler returns (before its result, so
// the control plane has every stored piece of a finished command). A piece
// written while no session is open waits, within Config.MaxUnsentOutput,
// and is sent right after the next Welcome.

// outputPieceBytes is the largest piece sent in one message.
const outputPieceBytes = 64 << 10

type outputKey struct{}

// Stdout is the writer for the standard output of the command whose
// Handler got ctx; io.Discard when ctx is not a Handler's. Writes never
// fail and never block on the network.
func Stdout(ctx context.Context) io.Writer {
	return outputFor(ctx, nodev1.OutputStream_OUTPUT_STREAM_STDOUT)
}

// Stderr is Stdout's counterpart for the standard error.
func Stderr(ctx context.Context) io.Writer {
	return outputFor(ctx, nodev1.OutputStream_OUTPUT_STREAM_STDERR)
}

// writers are the Stdout and Stderr of a WithOutput ctx.
type writers struct{ stdout, stderr io.Writer }

// WithOutput returns a ctx whose Stdout and Stderr are stdout and stderr,
// so a Handler can be run outside a daemon (its tests, a local CLI) with
// its live output observed. The writers must be safe for concurrent use:
// a Handler may write both streams from different goroutines. The
// innermost of WithOutput and a daemon's own output wins.
func WithOutput(ctx context.Context, stdout, stderr io.Writer) context.Context {
	return context.WithValue(ctx, outputKey{}, writers{stdout: stdout, stderr: stderr})
}

func outputFor(ctx context.Context, stream nodev1.OutputStream) io.Writer {
	switch o := ctx.Value(outputKey{}).(type) {
	case *output:
		return streamWriter{o: o, stream: stream}
	case writers:
		if stream == nodev1.OutputStream_OUTPUT_STREAM_STDERR {
			return o.stderr
		}
		return o.stdout
	}
	return io.Discard
}

type streamWriter struct {
	o      *output
	stream nodev1.OutputStream
}

func (w streamWriter) Write(p []byte) (int, error) {
	w.o.write(w.stream, p)
	return len(p), nil
}

// output coalesces one command's writes into CommandOutput messages.
type output struct {
	id    string
	send  func(*nodev1.ConnectRequest)
	clock clockwork.Clock
	every time.Duration
	limit int64 // bytes past which nothing more is sent

	mu     sync.Mutex
	offset int64 // of buf's first byte
	stream nodev1.OutputStream
	buf    []byte
	timer  clockwork.Timer
	closed bool
}

func (o *output) write(stream nodev1.OutputStream, p []byte) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed || len(p) == 0 {
		return
	}
	if len(o.buf) > 0 && stream != o.stream {
		o.flushLocked()
	}
	o.stream = stream
	for len(p) > 0 {
		room := o.limit - o.offset - int64(len(o.buf))
		if room <= 0 {
			break // past the daemon's cap: dropped
		}
		n := int(min(int64(len(p)), int64(outputPieceBytes-len(o.buf)), room))
		o.buf = append(o.buf, p[:n]...)
		p = p[n:]
		if len(o.buf) >= outputPieceBytes {
			o.flushLocked()
		}
	}
	if len(o.buf) > 0 && o.timer == nil {
		o.timer = o.clock.AfterFunc(o.every, o.flush)
	}
}

func (o *output) flush() {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.flushLocked()
}

func (o *output) flushLocked() {
	if o.timer != nil {
		o.timer.Stop()
		o.timer = nil
	}
	if len(o.buf) == 0 {
		return
	}
	o.send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandOutput{CommandOutput: &nodev1.CommandOutput{
		CommandId: o.id, Offset: o.offset, Stream: o.stream, Data: o.buf,
	}}})
	o.offset += int64(len(o.buf))
	o.buf = nil
}

// close sends what is buffered; later writes are dropped.
func (o *output) close() {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.flushLocked()
	o.closed = true
}

// sendOutput sends a piece now, or keeps it for the next session while the
// unsent pieces stay within MaxUnsentOutput.
func (d *Daemon) sendOutput(msg *nodev1.ConnectRequest) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.stream != nil {
		d.flushUnsentLocked()
		if len(d.unsent) == 0 {
			if err := d.stream.Send(msg); err == nil {
				return
			}
		}
		// The stream broke: keep the piece for the next session.
	}
	size := len(msg.GetCommandOutput().GetData())
	if d.unsentBytes+size > d.cfg.MaxUnsentOutput {
		d.droppedOutput.Add(int64(size))
		return
	}
	d.unsent = append(d.unsent, msg)
	d.unsentBytes += size
}

// flushUnsentLocked sends the pieces kept while no session was open; d.mu
// is held and d.stream is the new session's.
func (d *Daemon) flushUnsentLocked() {
	for len(d.unsent) > 0 {
		if err := d.stream.Send(d.unsent[0]); err != nil {
			return // kept for the next session
		}
		d.unsentBytes -= len(d.unsent[0].GetCommandOutput().GetData())
		d.unsent[0] = nil
		d.unsent = d.unsent[1:]
	}
	d.unsent = nil
}
