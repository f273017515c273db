package harness

import (
	"context"
	"fmt"
	"time"
)

// Sleep waits d or until ctx ends (then it returns ctx's error).
func Sleep(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// Poll checks cond every interval until it holds, timeout passes (an error)
// or ctx ends.
func Poll(ctx context.Context, timeout, every time.Duration, cond func() bool) error {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %s", timeout)
		}
		if err := Sleep(ctx, every); err != nil {
			return err
		}
	}
	return nil
}
