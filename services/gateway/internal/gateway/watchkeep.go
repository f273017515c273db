package gateway

// Output kept for late watchers. A reader rarely watches a command before
// its first byte: `leasehold run` learns the command's id from the run, and
// a quick command has printed (or finished) by then. So the gateway keeps,
// per command, the first keptPerCommand bytes past the stored cap in memory,
// and a watch that comes later is given them first, in order, before the
// live pieces: a reader that comes within keptFor of the result still gets
// the whole output of a command that printed up to cap + keptPerCommand.
// Past that the reader sees the gap as a truncation marker, as before.
// keptTotal bounds the memory over all commands: past it nothing more is
// kept until finished commands age out.

import (
	"time"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

const (
	// keptPerCommand is how many bytes past the cap one command keeps.
	keptPerCommand = 8 << 20
	// keptTotal bounds the kept bytes of all commands.
	keptTotal = 128 << 20
	// keptFor is how long after its result a command's kept output stays.
	keptFor = 30 * time.Second
)

// keptOutput is what a command's session kept past the cap.
type keptOutput struct {
	s        *session
	pieces   []*nodev1.CommandOutput
	bytes    int64
	full     bool      // a piece was not kept: what follows would have a gap
	finished time.Time // zero while the command runs
}

// keepLocked keeps p (read on s) for later watchers, within the bounds.
func (o *outputWatchers) keepLocked(s *session, p *nodev1.CommandOutput) {
	k := o.kept[p.GetCommandId()]
	if k == nil {
		if o.kept == nil {
			o.kept = make(map[string]*keptOutput)
		}
		k = &keptOutput{s: s}
		o.kept[p.GetCommandId()] = k
	}
	if k.s != s || k.full || !k.finished.IsZero() {
		return
	}
	n := int64(len(p.GetData()))
	if k.bytes+n > keptPerCommand || o.keptBytes+n > keptTotal {
		k.full = true
		return
	}
	k.pieces = append(k.pieces, p)
	k.bytes += n
	o.keptBytes += n
}

// keptFinishedLocked marks command's kept output on s finished (its result
// was read) and lets what finished longer ago than keptFor go.
func (o *outputWatchers) keptFinishedLocked(s *session, command string) {
	now := o.clock.Now()
	if k := o.kept[command]; k != nil && k.s == s {
		k.finished = now
	}
	for id, k := range o.kept {
		if !k.finished.IsZero() && now.Sub(k.finished) >= keptFor {
			o.dropKeptLocked(id, k)
		}
	}
}

// dropKeptLocked forgets a command's kept output.
func (o *outputWatchers) dropKeptLocked(command string, k *keptOutput) {
	o.keptBytes -= k.bytes
	delete(o.kept, command)
}

// keptSessionEndedLocked forgets the kept output of s's commands still
// running (they go on, if at all, on another session); finished ones stay
// for their keptFor.
func (o *outputWatchers) keptSessionEndedLocked(s *session) {
	for id, k := range o.kept {
		if k.s == s && k.finished.IsZero() {
			o.dropKeptLocked(id, k)
		}
	}
}
