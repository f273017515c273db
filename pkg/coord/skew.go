package coord

import (
	"log/slog"
	"sync"
	"time"
)

// DefaultSkewThreshold is the process-vs-database clock offset past which a
// process raises ClockSkew (docs/design.md#time).
const DefaultSkewThreshold = time.Second

// SkewDetector keeps the latest clock-skew sample from lease statements and
// logs when the offset crosses the threshold (and when it recovers).
type SkewDetector struct {
	threshold time.Duration
	logger    *slog.Logger
	onSample  func(time.Duration)

	mu     sync.Mutex
	last   time.Duration
	skewed bool
}

// NewSkewDetector returns a detector with the given threshold (0: 1 s).
// onSample, when not nil, receives every sample (a gauge's Set, say).
func NewSkewDetector(threshold time.Duration, logger *slog.Logger, onSample func(time.Duration)) *SkewDetector {
	if threshold <= 0 {
		threshold = DefaultSkewThreshold
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &SkewDetector{threshold: threshold, logger: logger, onSample: onSample}
}

// Observe records one sample: the process clock minus compute_now().
func (d *SkewDetector) Observe(skew time.Duration) {
	d.mu.Lock()
	was := d.skewed
	d.last = skew
	d.skewed = skew > d.threshold || skew < -d.threshold
	now := d.skewed
	d.mu.Unlock()
	if d.onSample != nil {
		d.onSample(skew)
	}
	switch {
	case now && !was:
		d.logger.Warn("ClockSkew: process clock differs from the database clock",
			"skew", skew, "threshold", d.threshold, "hint", "synchronise this host's clock (chrony/NTP); leases use the database clock but certificates and doctor ages do not")
	case !now && was:
		d.logger.Info("clock skew back within threshold", "skew", skew)
	}
}

// Last returns the latest sample and whether it is past the threshold.
func (d *SkewDetector) Last() (time.Duration, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.last, d.skewed
}
