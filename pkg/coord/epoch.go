package coord

import "fmt"

// The one rule for a lease's epoch, used by every statement that grants a
// lease (AcquireMany, Take, TakeFresh, and through Take the site boot lease):
//
//   - the same owner keeps its epoch: a renewal, or a re-take after an
//     expiry nobody else used, is not a new holder;
//   - a change of owner raises the epoch above both the row's epoch and
//     lease_epoch_floor(), which is (WAL timeline - 1) << 32 (migration
//     00014): an epoch issued after a promotion is above any issued before
//     it, even one the promoted standby never received, so no two holders
//     ever share an epoch across a failover.
//
// Fenced writes compare owner and epoch (fence.go), so a holder that lost
// its lease writes nothing, whatever the epoch numbers.

// nextEpochSQL returns the epoch expression of an UPDATE of leases whose new
// owner is the SQL parameter ownerParam (e.g. "$2").
func nextEpochSQL(ownerParam string) string {
	return fmt.Sprintf("CASE WHEN owner = %[1]s THEN epoch ELSE GREATEST(epoch, lease_epoch_floor()) + 1 END", ownerParam)
}

// freshEpochSQL is the epoch of a take that must start a new holding even by
// the same owner (a gateway re-serving after it fenced itself): always a rise.
const freshEpochSQL = "GREATEST(epoch, lease_epoch_floor()) + 1"

// acquiredAtSQL keeps acquired_at across renewals and resets it on a change
// of owner.
func acquiredAtSQL(ownerParam string) string {
	return fmt.Sprintf("CASE WHEN owner = %[1]s THEN acquired_at ELSE compute_now() END", ownerParam)
}
