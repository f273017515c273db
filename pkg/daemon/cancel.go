package daemon

import (
	"context"

	"google.golang.org/protobuf/types/known/timestamppb"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// Cancellation (docs/gateway.md, "Cancellation"): a CancelCommand from the
// gateway cancels the running command's context; once its Handler has
// returned and its result was sent, the daemon answers CancelAck
// STOPPED. A command that already ended is answered ALREADY_FINISHED
// (after its result is re-sent), and one never started is journalled as
// cancelled, so it never runs, and answered NOT_STARTED. An ack lost with
// its session is asked for again on the next Hello, and answered alike.

// maxStopped bounds the commands remembered as stopped by a cancel.
const maxStopped = 10000

// execution is a command whose Handler is running.
type execution struct {
	cancel context.CancelFunc
	// cancelRequested is set, under Daemon.mu, by a CancelCommand.
	cancelRequested bool
}

func (d *Daemon) handleCancel(c *nodev1.CancelCommand) {
	id := c.GetCommandId()
	if id == "" {
		return
	}
	d.cancels.Add(1)
	d.mu.Lock()
	if ex := d.running[id]; ex != nil {
		// The execution's goroutine acks once the Handler has returned.
		ex.cancelRequested = true
		d.mu.Unlock()
		ex.cancel()
		d.log.Info("command cancelled by the control plane; waiting for its handler", "command", id)
		return
	}
	if d.stopped[id] {
		d.mu.Unlock()
		d.sendCancelAck(id, nodev1.CancelOutcome_CANCEL_OUTCOME_STOPPED)
		return
	}
	result, executed := d.cfg.Journal.Seen(id)
	switch {
	case result != nil:
		d.mu.Unlock()
		d.sendResult(result)
		d.sendCancelAck(id, nodev1.CancelOutcome_CANCEL_OUTCOME_ALREADY_FINISHED)
	case executed:
		d.mu.Unlock()
		d.finish(id, &nodev1.CommandResult{CommandId: id, ResultId: id + "/interrupted", ExitCode: -1,
			Error: "the daemon stopped while this command ran; it is not run again", FinishedAt: timestamppb.New(d.clock.Now())})
		d.sendCancelAck(id, nodev1.CancelOutcome_CANCEL_OUTCOME_ALREADY_FINISHED)
	default:
		// Journalled with a result under d.mu, so a Command for it arriving
		// later re-sends this result instead of running.
		res := &nodev1.CommandResult{CommandId: id, ResultId: id + "/cancelled", ExitCode: -1,
			Error: "cancelled before it started", FinishedAt: timestamppb.New(d.clock.Now())}
		err := d.cfg.Journal.Record(id, res)
		d.mu.Unlock()
		if err != nil {
			d.log.Error("journal cancelled command; not acknowledging the cancel", "command", id, "err", err)
			return
		}
		d.sendResult(res)
		d.sendCancelAck(id, nodev1.CancelOutcome_CANCEL_OUTCOME_NOT_STARTED)
	}
}

// sendCancelAck answers a CancelCommand; without a session the ack is
// lost and the gateway asks again after the next Hello.
func (d *Daemon) sendCancelAck(id string, outcome nodev1.CancelOutcome) {
	if err := d.send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CancelAck{CancelAck: &nodev1.CancelAck{
		CommandId: id, Outcome: outcome}}}); err != nil {
		d.log.Debug("cancel ack not sent now; the gateway asks again", "command", id, "err", err)
	}
}
