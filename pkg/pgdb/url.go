package pgdb

import (
	"context"
	"errors"
	"fmt"
	"net"
	"reflect"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// ErrMultiHostAnyServer reports a database URL that lists several servers
// without target_session_attrs=read-write (or primary): a connection may land
// on a standby, where every write fails, or on a stale old primary.
var ErrMultiHostAnyServer = errors.New("lists several hosts without target_session_attrs=read-write (or primary)")

// ErrStandby reports a write pool that reached a server in recovery.
var ErrStandby = errors.New("points at a standby (pg_is_in_recovery() is true)")

// URLError is a database URL refused by its shape or by the server it
// reached. Setting names where the URL came from ("--database-url").
type URLError struct {
	Setting string
	Err     error
	// Hosts are the servers the URL lists, in dialling order.
	Hosts []string
}

func (e *URLError) Error() string {
	switch {
	case errors.Is(e.Err, ErrMultiHostAnyServer):
		return fmt.Sprintf("%s %s (%s): add target_session_attrs=read-write so a connection only lands on the primary, "+
			"e.g. postgres://user:pass@host1:5432,host2:5432/db?target_session_attrs=read-write",
			e.Setting, e.Err, strings.Join(e.Hosts, ", "))
	case errors.Is(e.Err, ErrStandby):
		return fmt.Sprintf("%s %s (%s): leasehold writes; point it at the primary, at a name or pooler that follows the primary, "+
			"or list every server with target_session_attrs=read-write", e.Setting, e.Err, strings.Join(e.Hosts, ", "))
	}
	return fmt.Sprintf("%s: %v", e.Setting, e.Err)
}

func (e *URLError) Unwrap() error { return e.Err }

// Hosts lists the distinct servers (host:port) a connection configuration
// dials, in order: its host and those of its fallbacks. A TLS and a plain
// attempt at one server (sslmode=prefer) count once.
func Hosts(cc *pgconn.Config) []string {
	var out []string
	seen := map[string]bool{}
	add := func(host string, port uint16) {
		hp := net.JoinHostPort(host, strconv.Itoa(int(port)))
		if !seen[hp] {
			seen[hp] = true
			out = append(out, hp)
		}
	}
	add(cc.Host, cc.Port)
	for _, fb := range cc.Fallbacks {
		add(fb.Host, fb.Port)
	}
	return out
}

// TargetSessionAttrs is the target_session_attrs a configuration was parsed
// with ("any", "read-write", "primary", "read-only", "standby",
// "prefer-standby"), or "custom" for a ValidateConnect set in code.
func TargetSessionAttrs(cc *pgconn.Config) string {
	if cc.ValidateConnect == nil {
		return "any"
	}
	got := reflect.ValueOf(cc.ValidateConnect).Pointer()
	for name, fn := range map[string]pgconn.ValidateConnectFunc{
		"read-write":     pgconn.ValidateConnectTargetSessionAttrsReadWrite,
		"primary":        pgconn.ValidateConnectTargetSessionAttrsPrimary,
		"read-only":      pgconn.ValidateConnectTargetSessionAttrsReadOnly,
		"standby":        pgconn.ValidateConnectTargetSessionAttrsStandby,
		"prefer-standby": pgconn.ValidateConnectTargetSessionAttrsPreferStandby,
	} {
		if reflect.ValueOf(fn).Pointer() == got {
			return name
		}
	}
	return "custom"
}

// WritesOnlyToPrimary reports whether a connection on cc can only land on a
// server that takes writes: a single server (checked once connected), or
// several with target_session_attrs read-write or primary.
func WritesOnlyToPrimary(cc *pgconn.Config) bool {
	if len(Hosts(cc)) < 2 {
		return true
	}
	switch TargetSessionAttrs(cc) {
	case "read-write", "primary":
		return true
	}
	return false
}

// CheckURL parses url (a URL or keyword/value DSN) and refuses a multi-host
// one without target_session_attrs=read-write or primary, with a *URLError
// naming setting. It does not dial.
func CheckURL(url, setting string) error {
	cc, err := pgconn.ParseConfig(url)
	if err != nil {
		return &URLError{Setting: setting, Err: fmt.Errorf("parse: %w", err)}
	}
	return checkConfig(cc, setting)
}

func checkConfig(cc *pgconn.Config, setting string) error {
	if !WritesOnlyToPrimary(cc) {
		return &URLError{Setting: setting, Err: ErrMultiHostAnyServer, Hosts: Hosts(cc)}
	}
	return nil
}

// checkPrimary refuses a server in recovery for a write pool.
func checkPrimary(ctx context.Context, q Querier, cc *pgconn.Config, setting string) error {
	var recovery bool
	if err := q.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&recovery); err != nil {
		return fmt.Errorf("read pg_is_in_recovery(): %w", err)
	}
	if recovery {
		return &URLError{Setting: setting, Err: ErrStandby, Hosts: Hosts(cc)}
	}
	return nil
}
