package cli

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestWindowSlides checks the fan-out's window: never more than the limit
// at once, and a finished call lets the next start before the slower ones
// of its "batch" end.
func TestWindowSlides(t *testing.T) {
	var running, peak atomic.Int32
	var mu sync.Mutex
	var order []int
	release := make([]chan struct{}, 5)
	for i := range release {
		release[i] = make(chan struct{})
	}
	done := make(chan struct{})
	go func() {
		window(context.Background(), 5, 2, func(i int) {
			n := running.Add(1)
			for {
				p := peak.Load()
				if n <= p || peak.CompareAndSwap(p, n) {
					break
				}
			}
			mu.Lock()
			order = append(order, i)
			mu.Unlock()
			<-release[i]
			running.Add(-1)
		})
		close(done)
	}()
	started := func() []int {
		mu.Lock()
		defer mu.Unlock()
		return append([]int(nil), order...)
	}
	waitFor := func(n int) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for len(started()) < n {
			if time.Now().After(deadline) {
				t.Fatalf("started %v, want %d", started(), n)
			}
			time.Sleep(time.Millisecond) // poll interval
		}
	}
	waitFor(2)
	close(release[1]) // 0 still runs: 2 starts in 1's slot
	waitFor(3)
	if got := started(); got[2] != 2 {
		t.Fatalf("order %v", got)
	}
	time.Sleep(20 * time.Millisecond) // nothing else may start meanwhile
	if got := len(started()); got != 3 {
		t.Fatalf("%d started with two slots busy", got)
	}
	close(release[0])
	close(release[2])
	waitFor(5)
	close(release[3])
	close(release[4])
	<-done
	if peak.Load() != 2 {
		t.Fatalf("peak %d, want 2", peak.Load())
	}
}

// TestWindowStopsOnCancel: no call starts once the context is done.
func TestWindowStopsOnCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var calls atomic.Int32
	window(ctx, 10, 1, func(int) {
		if calls.Add(1) == 2 {
			cancel()
		}
	})
	if n := calls.Load(); n != 2 {
		t.Fatalf("%d calls, want 2", n)
	}
}
