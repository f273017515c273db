package process

import "github.com/grafana/dskit/services"

// NewPlanStats exposes the plan-statistics component to the package's
// tests, which run it on a fake clock.
func NewPlanStats(p *Process) services.Service { return newPlanStats(p) }

// PlanStatsEvery is the component's period.
const PlanStatsEvery = planStatsEvery
