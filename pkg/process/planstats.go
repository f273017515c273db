package process

import (
	"context"
	"time"

	"github.com/grafana/dskit/services"

	"github.com/leasehold/leasehold/pkg/pgdb"
)

// planStatsEvery is how often a process whose pool plans generically
// (Spec.GenericPlans) looks for tables grown well past their statistics: a
// generic plan made on a near-empty table is replaced within about this long
// of the table outgrowing it (pgdb.RefreshPlanStats).
const planStatsEvery = time.Second

// newPlanStats is the component that runs pgdb.RefreshPlanStats every
// planStatsEvery on the process clock. A lost database is not logged here
// (every other component reports it); any other failure is, at most once a
// minute.
func newPlanStats(p *Process) services.Service {
	return services.NewBasicService(nil, func(ctx context.Context) error {
		t := p.Clock.NewTicker(planStatsEvery)
		defer t.Stop()
		var lastWarn time.Time
		for {
			select {
			case <-ctx.Done():
				return nil
			case <-t.Chan():
			}
			done, err := pgdb.RefreshPlanStats(ctx, p.DB, pgdb.PlanStatsMinRows, pgdb.PlanStatsGrowth)
			for _, s := range done {
				p.Logger.Info("planner statistics refreshed: a cached generic plan is made again from the table's size",
					"table", s.Name, "planned_rows", s.PlannedRows, "live_rows", s.LiveRows)
			}
			if err != nil && ctx.Err() == nil && !pgdb.IsConnectionError(err) {
				if now := p.Clock.Now(); now.Sub(lastWarn) >= time.Minute {
					lastWarn = now
					p.Logger.Warn("planner statistics pass failed", "err", err)
				}
			}
		}
	}, nil).WithName("plan-stats")
}
