package nodeexec

import (
	"context"
	"fmt"
	"log/slog"
	"os/exec"
	"strings"
	"time"

	"github.com/leasehold/leasehold/pkg/daemon"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// reboot schedules Config.RebootCommand after the payload's delay (5 s
// when unset or 0) and returns at once, so the result reaches the gateway
// before the node goes down. Without Config.AllowReboot it is refused. A
// second reboot while one is scheduled changes nothing and says so.
func (e *Executor) reboot(log *slog.Logger, p *nodev1.RebootPayload) daemon.Outcome {
	if !e.cfg.AllowReboot {
		return failf(CodeRebootNotAllowed, "this node does not allow reboot commands (leasehold-node --allow-reboot)")
	}
	delay := p.GetDelay().AsDuration()
	if delay <= 0 {
		delay = DefaultRebootDelay
	}
	argv := e.cfg.RebootCommand
	e.rebootMu.Lock()
	defer e.rebootMu.Unlock()
	if !e.rebootAt.IsZero() {
		return daemon.Outcome{Output: fmt.Appendf(nil, "a reboot is already scheduled at %s\n", e.rebootAt.UTC().Format(time.RFC3339))}
	}
	select {
	case <-e.closing:
		return failf(CodeRebootNotAllowed, "the agent is stopping")
	default:
	}
	e.rebootAt = time.Now().Add(delay)
	log.Warn("reboot scheduled", "delay", delay, "reason", p.GetReason(), "command", argv)
	e.wg.Go(func() {
		t := time.NewTimer(delay)
		defer t.Stop()
		select {
		case <-e.closing:
			log.Warn("scheduled reboot cancelled: the agent is stopping")
			e.rebootMu.Lock()
			e.rebootAt = time.Time{}
			e.rebootMu.Unlock()
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		out, err := exec.CommandContext(ctx, argv[0], argv[1:]...).CombinedOutput() //nolint:gosec // the operator's configured command
		if err != nil {
			log.Error("reboot command failed", "command", argv, "err", err, "output", string(out))
			e.rebootMu.Lock()
			e.rebootAt = time.Time{} // a later reboot command may try again
			e.rebootMu.Unlock()
			return
		}
		log.Warn("reboot command ran", "command", argv)
	})
	return daemon.Outcome{Output: fmt.Appendf(nil, "reboot in %s: %s\n", delay, strings.Join(argv, " "))}
}
