// Package reload re-reads configuration files while a process runs, so a
// renewed TLS certificate, a rotated client CA or an edited API tokens file
// takes effect without a restart.
//
// A Watcher reads its files on a ticker and hands their contents to a load
// function when any byte changed (a SHA-256 of the contents, not the mtime,
// so a rewrite within the same second is seen and a touch is not). A load
// that fails keeps what was loaded before: the error is logged, counted on
// leasehold_config_reloads_total{result="error"} and flagged on
// leasehold_config_reload_failing until a later version of the files loads.
// Kubernetes' atomic symlink swap of a mounted Secret, cert-manager's
// renewals and a plain `mv new old` are all seen on the next tick.
package reload

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/jonboulle/clockwork"
	"github.com/prometheus/client_golang/prometheus"
)

// DefaultInterval is how often files are re-read when a service does not
// say otherwise.
const DefaultInterval = 10 * time.Second

// LoadFunc installs the contents of a Watcher's files, in the order of its
// paths. It must either install all of them or nothing and return an error.
type LoadFunc func(contents [][]byte) error

// Options are a Watcher's collaborators; zero values are usable.
type Options struct {
	// Logger gets one line per reload and per failure (nil: discarded).
	Logger *slog.Logger
	// Registerer gets the reload metrics (nil: not exported).
	Registerer prometheus.Registerer
	// Clock drives the ticker of Run (nil: real).
	Clock clockwork.Clock
}

// Watcher re-reads a set of files and reloads them when their contents
// change.
type Watcher struct {
	name  string
	paths []string
	load  LoadFunc
	log   *slog.Logger
	clock clockwork.Clock
	m     *metrics

	mu      sync.Mutex
	loaded  [sha256.Size]byte // contents last installed
	tried   [sha256.Size]byte // contents last attempted (failed when != loaded)
	lastErr string
}

// NewWatcher reads paths and loads them once: an error here (a missing file,
// a bad certificate) is the caller's start-up error. name labels the metrics
// and logs ("gateway-tls", "api-tokens").
func NewWatcher(name string, paths []string, load LoadFunc, opts Options) (*Watcher, error) {
	if len(paths) == 0 {
		return nil, fmt.Errorf("reload %s: no files", name)
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Clock == nil {
		opts.Clock = clockwork.NewRealClock()
	}
	w := &Watcher{name: name, paths: paths, load: load, log: opts.Logger.With("config", name, "files", paths),
		clock: opts.Clock, m: newMetrics(opts.Registerer, name)}
	contents, sum, err := w.read()
	if err != nil {
		return nil, err
	}
	if err := load(contents); err != nil {
		return nil, err
	}
	w.loaded, w.tried = sum, sum
	w.m.set(true)
	return w, nil
}

func (w *Watcher) read() ([][]byte, [sha256.Size]byte, error) {
	h := sha256.New()
	contents := make([][]byte, len(w.paths))
	for i, p := range w.paths {
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, [sha256.Size]byte{}, fmt.Errorf("read %s: %w", p, err)
		}
		contents[i] = b
		fmt.Fprintf(h, "%d:", len(b))
		h.Write(b)
	}
	var sum [sha256.Size]byte
	copy(sum[:], h.Sum(nil))
	return contents, sum, nil
}

// ErrUnchanged is returned by Check when the files are as last attempted.
var ErrUnchanged = errors.New("files unchanged")

// Check re-reads the files once and loads them when they changed since the
// last attempt. It returns nil after a reload, ErrUnchanged when there was
// nothing new, or the read or load error (the previous contents stay in
// force).
func (w *Watcher) Check() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	contents, sum, err := w.read()
	if err != nil {
		w.fail(err)
		return err
	}
	if sum == w.tried {
		if sum != w.loaded {
			return fmt.Errorf("reload %s: these contents failed to load before: %s", w.name, w.lastErr)
		}
		return ErrUnchanged
	}
	w.tried = sum
	if err := w.load(contents); err != nil {
		err = fmt.Errorf("reload %s: %w", w.name, err)
		w.fail(err)
		return err
	}
	w.loaded, w.lastErr = sum, ""
	w.m.reloads.WithLabelValues("ok").Inc()
	w.m.set(true)
	w.log.Info("configuration files reloaded")
	return nil
}

// fail counts a failed attempt and logs it once per distinct error.
func (w *Watcher) fail(err error) {
	w.m.reloads.WithLabelValues("error").Inc()
	w.m.set(false)
	if err.Error() != w.lastErr {
		w.log.Error("configuration files not reloaded; the previous ones stay in force", "err", err)
	}
	w.lastErr = err.Error()
}

// Run calls Check every interval until ctx ends.
func (w *Watcher) Run(ctx context.Context, every time.Duration) {
	if every <= 0 {
		every = DefaultInterval
	}
	t := w.clock.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.Chan():
			_ = w.Check()
		}
	}
}
