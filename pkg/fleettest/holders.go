package fleettest

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Holders records every (lease, epoch) -> owners pair the leases table
// showed, polled every 20 ms on whichever server db reaches (after a
// failover, the promoted standby): two owners at one epoch of one lease are
// two processes acting as its holder, even when the grant of one of them
// was lost with the old primary.
type Holders struct {
	mu   sync.Mutex
	seen map[string]map[string]bool // "name@epoch" -> owners
	stop chan struct{}
	done chan struct{}
}

// WatchHolders starts polling db; call Stop to end it.
func WatchHolders(db *pgxpool.Pool) *Holders {
	h := &Holders{seen: map[string]map[string]bool{}, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(h.done)
		for {
			select {
			case <-h.stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			h.poll(db)
		}
	}()
	return h
}

func (h *Holders) poll(db *pgxpool.Pool) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	rows, err := db.Query(ctx, `SELECT name, owner, epoch FROM leases WHERE owner IS NOT NULL`)
	if err != nil {
		return // the database is away: nothing to see this time
	}
	defer rows.Close()
	for rows.Next() {
		var name, owner string
		var epoch int64
		if rows.Scan(&name, &owner, &epoch) != nil {
			continue
		}
		k := fmt.Sprintf("%s@%d", name, epoch)
		h.mu.Lock()
		if h.seen[k] == nil {
			h.seen[k] = map[string]bool{}
		}
		h.seen[k][owner] = true
		h.mu.Unlock()
	}
}

// Stop ends the watch and returns every "lease@epoch" seen with more than
// one owner (owners sorted), and how many (lease, epoch) pairs were seen.
func (h *Holders) Stop() (bad []string, pairs int) {
	close(h.stop)
	<-h.done
	h.mu.Lock()
	defer h.mu.Unlock()
	for k, owners := range h.seen {
		if len(owners) > 1 {
			names := make([]string, 0, len(owners))
			for o := range owners {
				names = append(names, o)
			}
			sort.Strings(names)
			bad = append(bad, fmt.Sprintf("%s held by %v", k, names))
		}
	}
	sort.Strings(bad)
	return bad, len(h.seen)
}
