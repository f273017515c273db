package coord

import "fmt"

// The one rule for a lease's epoch, used by every statement that grants a
// lease (AcquireMany, Take, TakeFresh, and through Take the site boot lease):
//
//   - the same owner keeps its epoch: a renewal, or a re-take after an
//     expiry nobody else used, is not a new holding; unless the row's epoch
//     is below the epoch this process last held it at (the database went
//     back in time: restore.go), which makes it a new holding;
//   - a new holding calls lease_new_epoch(epoch, seen) (migration 00030): it
//     counts the grant (lease_grants) and raises the epoch above the row's
//     epoch, above what this process saw (seen; 0 for callers without a
//     Client), and above lease_epoch_floor(), which is
//     (generation << 48) + ((WAL timeline - 1) << 32) (migrations 00014 and
//     00030): an epoch issued after a promotion, or after a detected
//     restore, is above any issued before it, even one the database no
//     longer has, so no two holders ever share an epoch across a failover
//     or a restore.
//
// Fenced writes compare owner and epoch (fence.go), so a holder that lost
// its lease writes nothing, whatever the epoch numbers.

// nextEpochSQL returns the epoch expression of an UPDATE of leases whose new
// owner is the SQL parameter ownerParam (e.g. "$2") by a process that last
// held the lease at seen (an SQL expression; "0" when it does not remember).
func nextEpochSQL(ownerParam, seen string) string {
	return fmt.Sprintf("CASE WHEN %s THEN epoch ELSE %s END", keepsEpochSQL(ownerParam, seen), freshEpochSQL(seen))
}

// keepsEpochSQL is true when a grant keeps the row's epoch: the same owner,
// at an epoch not below the one it remembers.
func keepsEpochSQL(ownerParam, seen string) string {
	return fmt.Sprintf("owner = %s AND epoch >= %s", ownerParam, seen)
}

// freshEpochSQL is the epoch of a take that must start a new holding even by
// the same owner (a gateway re-serving after it fenced itself): always a rise.
func freshEpochSQL(seen string) string {
	return fmt.Sprintf("lease_new_epoch(epoch, %s)", seen)
}

// acquiredAtSQL keeps acquired_at while the epoch is kept and resets it on
// a new holding.
func acquiredAtSQL(ownerParam, seen string) string {
	return fmt.Sprintf("CASE WHEN %s THEN acquired_at ELSE compute_now() END", keepsEpochSQL(ownerParam, seen))
}
