package harness

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"
)

// Dist summarises a distribution of durations, in seconds.
type Dist struct {
	N    int     `json:"n"`
	Min  float64 `json:"min_s"`
	P50  float64 `json:"p50_s"`
	P90  float64 `json:"p90_s"`
	P99  float64 `json:"p99_s"`
	Max  float64 `json:"max_s"`
	Mean float64 `json:"mean_s"`
}

// Summarize computes a Dist (nearest-rank percentiles).
func Summarize(ds []time.Duration) Dist {
	if len(ds) == 0 {
		return Dist{}
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	rank := func(p float64) float64 {
		i := int(p*float64(len(s))+0.999999) - 1
		i = max(0, min(len(s)-1, i))
		return s[i].Seconds()
	}
	var sum time.Duration
	for _, d := range s {
		sum += d
	}
	return Dist{N: len(s), Min: s[0].Seconds(), P50: rank(0.5), P90: rank(0.9), P99: rank(0.99),
		Max: s[len(s)-1].Seconds(), Mean: (sum / time.Duration(len(s))).Seconds()}
}

func (d Dist) String() string {
	if d.N == 0 {
		return "n=0"
	}
	return fmt.Sprintf("p50 %.2fs  p99 %.2fs  max %.2fs  (min %.2fs, n=%d)", d.P50, d.P99, d.Max, d.Min, d.N)
}

// WriteJSON writes v indented to path ("" does nothing), creating the
// path's directory when missing.
func WriteJSON(path string, v any) error {
	if path == "" {
		return nil
	}
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Errorf("encode results: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("results directory: %w", err)
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}
