package main

import (
	"context"
	"sync"
	"time"

	"github.com/leasehold/leasehold/bench/internal/fleet"
)

// sampler reads the database once a second: transactions committed and
// nodes marked unreachable while their daemon holds a live session.
type sampler struct {
	f   *fleet.Fleet
	sim *fleet.Sim
	now func() time.Time // the bench's clock (simulated in a scaled run)

	mu         sync.Mutex
	fault      time.Time
	rates      []rateSample
	falseNodes map[string]bool
	samples    int
}

type rateSample struct {
	at   time.Time
	rate float64
}

func newSampler(f *fleet.Fleet, sim *fleet.Sim, now func() time.Time) *sampler {
	return &sampler{f: f, sim: sim, now: now, falseNodes: map[string]bool{}}
}

func (s *sampler) markFault(t time.Time) {
	s.mu.Lock()
	s.fault = t
	s.mu.Unlock()
}

func (s *sampler) run(ctx context.Context) {
	byID := map[string]*fleet.Node{}
	for _, n := range s.sim.Nodes {
		byID[n.ID] = n
	}
	prev, _ := s.f.DB.Xacts(ctx)
	prevAt := s.now()
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		x, err := s.f.DB.Xacts(ctx)
		now := s.now()
		if err == nil {
			s.mu.Lock()
			s.rates = append(s.rates, rateSample{at: now, rate: float64(x-prev) / now.Sub(prevAt).Seconds()})
			s.mu.Unlock()
			prev, prevAt = x, now
		}
		// A node marked unreachable is a false mark when its daemon has a
		// session open (it never stops in this bench), or when the database
		// itself shows a connected session on a gateway holding its lease.
		rows, err := s.f.DB.Pool.Query(ctx, `SELECT n.id /*bench*/,
			coalesce(s.state = 'connected' AND l.expires_at > compute_now(), false)
			  FROM nodes n LEFT JOIN node_sessions s ON s.node_id = n.id
			  LEFT JOIN leases l ON l.name = 'gateway:' || s.gateway_id
			 WHERE n.state = 'unreachable'`)
		if err != nil {
			continue
		}
		var marked []string
		for rows.Next() {
			var id string
			var liveInDB bool
			if rows.Scan(&id, &liveInDB) == nil {
				if liveInDB || (byID[id] != nil && byID[id].D.Welcome() != nil) {
					marked = append(marked, id)
				}
			}
		}
		rows.Close()
		s.mu.Lock()
		s.samples++
		for _, id := range marked {
			s.falseNodes[id] = true
		}
		s.mu.Unlock()
	}
}

func (s *sampler) lastRate() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.rates) == 0 {
		return 0
	}
	return s.rates[len(s.rates)-1].rate
}

// xactStats returns the mean rate before the fault, the mean after it and
// the peak one-second rate after it.
func (s *sampler) xactStats() (steady, after, peak float64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var nb, na int
	for _, r := range s.rates {
		if r.at.Before(s.fault) {
			steady += r.rate
			nb++
		} else {
			after += r.rate
			na++
			peak = max(peak, r.rate)
		}
	}
	if nb > 0 {
		steady /= float64(nb)
	}
	if na > 0 {
		after /= float64(na)
	}
	return steady, after, peak
}
