package coord

// GatewayLeasePrefix starts the lease a gateway keeps while it serves:
// gateway:<id>. Node sessions are routed through it (docs/design.md#gateways).
const GatewayLeasePrefix = "gateway:"

// GatewayLease is the name of the lease gateway id keeps.
func GatewayLease(id string) string { return GatewayLeasePrefix + id }

// GatewayLeaseLive returns the SQL boolean expression "the gateway whose id
// is the SQL expression gatewayID holds its lease now": owned and not
// expired on the database clock. It is the one spelling of the rule for
// every statement that asks whether a node's session is on a live gateway
// (a dead gateway's sessions count as gone at once); it reads the leases
// table without locking it, and is false for a NULL id.
func GatewayLeaseLive(gatewayID string) string {
	return `EXISTS (SELECT 1 FROM leases gl WHERE gl.name = '` + GatewayLeasePrefix + `' || ` + gatewayID +
		` AND gl.owner IS NOT NULL AND gl.expires_at > compute_now())`
}

// GatewayLeaseLiveAt is GatewayLeaseLive at one epoch: true only while the
// lease is held at the SQL expression epoch, so a row a gateway wrote
// under its lease is not trusted once another holder (the same id
// restarted, a successor) has taken the lease since.
func GatewayLeaseLiveAt(gatewayID, epoch string) string {
	return `EXISTS (SELECT 1 FROM leases gl WHERE gl.name = '` + GatewayLeasePrefix + `' || ` + gatewayID +
		` AND gl.epoch = ` + epoch + ` AND gl.owner IS NOT NULL AND gl.expires_at > compute_now())`
}
