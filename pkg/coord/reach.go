package coord

import (
	"errors"

	"github.com/jackc/pgx/v5/pgconn"
)

// Unreachable reports whether err means the database did not answer (or
// answered only that it cannot serve writes now), as opposed to answering a
// statement with an error of its own. A loop that fails for an unreachable
// database is waiting, not stalled: restarting the process would not help.
//
// Every error that is not a PostgreSQL error response counts as unreachable
// (refused or reset connections, timeouts, a closed socket), and so do the
// responses of a server that is going away or not yet there: class 08
// (connection exception), 57P01-57P03 (shutdown, crash, starting up), 53300
// (too many connections) and 25006 (read-only transaction: the URL reached
// a standby, e.g. during a failover).
func Unreachable(err error) bool {
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return true
	}
	switch {
	case len(pgErr.Code) == 5 && pgErr.Code[:2] == "08":
		return true
	case pgErr.Code == "57P01", pgErr.Code == "57P02", pgErr.Code == "57P03":
		return true
	case pgErr.Code == "53300", pgErr.Code == "25006":
		return true
	}
	return false
}
