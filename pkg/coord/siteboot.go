package coord

// SiteBootLease is the boot lease of a bare-metal site, site:<id>:boot: its
// owner is the site agent that answers the site's boot requests, and the
// worker holding the site's shard renews or moves it on the agent's behalf
// (Ensure, LockForHandover, Renew, Take).
func SiteBootLease(siteID string) string { return "site:" + siteID + ":boot" }

// FenceSiteBootSQL is the fence of a site agent's report on its boot lease,
// for a caller that knows the agent but not its site: the lease is named
// through the agent's nodes row (SiteBootLease of nodes.site_id). $1 is the
// agent's node id, the lease's owner; $2 the epoch the agent reports. It
// returns the epoch, and no row when the agent does not hold its site's
// boot lease at that epoch now (not a site agent, another owner or epoch,
// expired). The gateway runs it first in the transaction that stores a
// site agent's discovery report.
//
// It locks the lease row FOR KEY SHARE OF l, as Fence does, and for the
// same reason: what must wait for the report is every write that ends the
// agent's holding, and each changes a key column (a promotion of another
// agent or a fresh take raises the epoch, a release clears the owner), so
// it waits until the report's transaction ends. The site boot reconciler's
// LockForHandover (FOR UPDATE) waits too, so no promotion is even decided
// while a report is being stored. A renewal, which moves only expires_at,
// does not wait; it ends no holding. The nodes row is read, not locked.
const FenceSiteBootSQL = `
SELECT l.epoch
  FROM nodes n
  JOIN leases l ON l.name = 'site:' || n.site_id || ':boot'
 WHERE n.id = $1 AND n.kind = 'site_agent'
   AND l.owner = $1 AND l.epoch = $2 AND l.expires_at > compute_now()
   FOR KEY SHARE OF l`
