package pgnotify

// The NOTIFY channels of leasehold. Each name is defined here once; the SQL
// that notifies on it either builds its statement from the constant (the
// lease release statements of pkg/coord) or is a migration trigger whose
// literal must match it (checked by TestChannelsMatchMigrations).
const (
	// LeaseReleased carries the name of every lease a release statement of
	// pkg/coord gives up, so a process that wants it takes it at once.
	LeaseReleased = "leasehold_lease_released"
	// Commands carries the node id of every inserted command (the trigger of
	// migration 00008), so the gateway holding that node dispatches at once.
	Commands = "leasehold_commands"
	// NodeSpec carries the node id of every node whose spec changed (the
	// trigger of migration 00013), so its gateway pushes the new spec.
	NodeSpec = "leasehold_node_spec"
)

// Channels lists every channel above.
var Channels = []string{LeaseReleased, Commands, NodeSpec}
