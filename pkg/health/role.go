package health

import "github.com/prometheus/client_golang/prometheus"

// Role is a process's standing for the thing it leads (docs/design.md#observability).
type Role int

// Role values exported on leasehold_role.
const (
	RoleStandby Role = 0
	RoleActive  Role = 1
	RoleFenced  Role = 2
)

func (r Role) String() string {
	switch r {
	case RoleActive:
		return "active"
	case RoleFenced:
		return "fenced"
	default:
		return "standby"
	}
}

// RoleGauge exports leasehold_role{component} as 0 standby, 1 active, 2 fenced.
type RoleGauge struct{ g prometheus.Gauge }

// NewRoleGauge registers the role gauge of component on reg.
func NewRoleGauge(reg prometheus.Registerer, component string) *RoleGauge {
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "leasehold_role",
		Help:        "Role of this process for its component: 0 standby, 1 active, 2 fenced.",
		ConstLabels: prometheus.Labels{"component": component},
	})
	reg.MustRegister(g)
	return &RoleGauge{g: g}
}

// Set exports r.
func (g *RoleGauge) Set(r Role) { g.g.Set(float64(r)) }
