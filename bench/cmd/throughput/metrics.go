package main

import (
	"bufio"
	"context"
	"fmt"
	"math"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"
)

// histogram is a Prometheus histogram's cumulative buckets (upper bound to
// count), read from a /metrics page.
type histogram map[float64]float64

// scrapeHistogram reads the buckets of histogram name from url.
func scrapeHistogram(ctx context.Context, url, name string) (histogram, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", url, err)
	}
	defer resp.Body.Close()
	h := histogram{}
	prefix := name + `_bucket{le="`
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		if !strings.HasPrefix(l, prefix) {
			continue
		}
		rest := l[len(prefix):]
		q := strings.IndexByte(rest, '"')
		if q < 0 {
			continue
		}
		le, err := strconv.ParseFloat(rest[:q], 64)
		if err != nil {
			continue
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(rest[strings.LastIndexByte(rest, ' ')+1:]), 64)
		if err != nil {
			continue
		}
		h[le] += v
	}
	return h, sc.Err()
}

// sub is h minus an earlier scrape.
func (h histogram) sub(before histogram) histogram {
	out := histogram{}
	for le, v := range h {
		out[le] = v - before[le]
	}
	return out
}

// add sums histograms (several gateways).
func (h histogram) add(o histogram) histogram {
	out := histogram{}
	for le, v := range h {
		out[le] = v
	}
	for le, v := range o {
		out[le] += v
	}
	return out
}

// quantile estimates quantile q in seconds by linear interpolation inside
// the bucket, as PromQL's histogram_quantile does; 0 with no observations.
func (h histogram) quantile(q float64) float64 {
	les := make([]float64, 0, len(h))
	for le := range h {
		les = append(les, le)
	}
	sort.Float64s(les)
	if len(les) == 0 {
		return 0
	}
	total := h[math.Inf(1)]
	if total <= 0 {
		return 0
	}
	rank := q * total
	prevLe, prevCount := 0.0, 0.0
	for _, le := range les {
		c := h[le]
		if c >= rank {
			if math.IsInf(le, 1) {
				return prevLe
			}
			if c == prevCount {
				return le
			}
			return prevLe + (le-prevLe)*(rank-prevCount)/(c-prevCount)
		}
		prevLe, prevCount = le, c
	}
	return prevLe
}

// count is the number of observations.
func (h histogram) count() float64 { return h[math.Inf(1)] }
