package pgnotify

// The NOTIFY channels of leasehold. Each name is defined here once; the SQL
// that notifies on it either builds its statement from the constant (the
// lease release statements of pkg/coord) or is a migration trigger whose
// literal must match it (checked by TestChannelsMatchMigrations).
const (
	// LeaseReleased carries the name of every lease a release statement of
	// pkg/coord gives up, so a process that wants it takes it at once.
	LeaseReleased = "leasehold_lease_released"
	// Commands wakes the gateways for new commands: pkg/cmdwake sends at
	// most one NOTIFY per few milliseconds after the creating commit,
	// naming the nodes that got commands ("" for every session). Migration
	// 00008's per-insert trigger sent one per command until migration 00016
	// dropped it.
	Commands = "leasehold_commands"
	// CommandDone is NOTIFYed (empty payload) by a gateway's group commit
	// that finished commands, so the api's WaitCommand looks at once.
	CommandDone = "leasehold_command_done"
	// NodeSpec carries the node id of every node whose spec changed (the
	// trigger of migration 00013), so its gateway pushes the new spec.
	NodeSpec = "leasehold_node_spec"
	// CommandOutput is NOTIFYed by a gateway's group commit that stored
	// live command output, once per batch; the payload is a comma-separated
	// list of the command ids ("" when the list would pass 7,900 bytes: every
	// reader looks), never the output itself, so PostgreSQL's 8,000-byte
	// payload limit is never reached. The api's StreamCommandOutput readers
	// wake on it and read the output from the database.
	CommandOutput = "leasehold_command_output"
)

// Channels lists every channel above.
var Channels = []string{LeaseReleased, Commands, NodeSpec, CommandDone, CommandOutput}
