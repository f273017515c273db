// Package doctor computes findings about a leasehold deployment from what its
// PostgreSQL database says: leases, workers, the work queue, gateways, node
// sessions and the server itself. Every check reads, never writes, so a
// read-only role is enough (SELECT on leasehold's tables plus pg_monitor).
//
// Each check yields one Finding with a stable code. A check that cannot run
// (permission denied, a view an older server lacks, a timeout) yields a
// finding with Checked false, SeverityUnknown and the reason, never a pass.
package doctor

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The finding codes, stable across releases.
const (
	CodeWorkersQueue       = "workers.queue"
	CodeWorkersSweeper     = "workers.sweeper"
	CodeWorkersMembership  = "workers.membership"
	CodeLeasesClockSkew    = "leases.clock_skew"
	CodeLeasesStuck        = "leases.stuck"
	CodeGatewaysNone       = "gateways.none"
	CodeGatewaysHeadroom   = "gateways.headroom"
	CodeNodesUnreachable   = "nodes.unreachable"
	CodeNodesDisconnected  = "nodes.disconnected"
	CodeSitesBoot          = "sites.boot"
	CodeDBVersion          = "db.version"
	CodeDBMigrations       = "db.migrations"
	CodeDBPooling          = "db.pooling"
	CodeDBReplication      = "db.replication"
	CodeDBURL              = "db.url"
	CodeDBConnections      = "db.connections"
	maxEvidenceRows        = 10
	clockSkewThresholdMs   = 1000
	minSupportedServerNum  = 140000
	minSupportedServerName = "14"
)

// checkFunc runs one check; an error makes the finding unchecked.
type checkFunc func(ctx context.Context, d *Doctor) (Finding, error)

var checks = map[string]checkFunc{
	CodeWorkersQueue:      checkQueue,
	CodeWorkersSweeper:    checkSweeper,
	CodeWorkersMembership: checkMembership,
	CodeLeasesClockSkew:   checkClockSkew,
	CodeLeasesStuck:       checkStuck,
	CodeGatewaysNone:      checkGatewaysNone,
	CodeGatewaysHeadroom:  checkHeadroom,
	CodeNodesUnreachable:  checkNodesUnreachable,
	CodeNodesDisconnected: checkNodesDisconnected,
	CodeNodesVersions:     checkNodesVersions,
	CodeNodesClockSkew:    checkNodesClockSkew,
	CodeSitesBoot:         checkSitesBoot,
	CodeDBVersion:         checkVersion,
	CodeDBMigrations:      checkMigrations,
	CodeDBPooling:         checkPooling,
	CodeDBReplication:     checkReplication,
	CodeDBURL:             checkURL,
	CodeDBConnections:     checkConnections,
	CodeDBRestored:        checkRestored,
	CodeTLSExpiry:         checkTLSExpiry,
}

// Codes returns every finding code, sorted.
func Codes() []string {
	out := make([]string, 0, len(checks))
	for c := range checks {
		out = append(out, c)
	}
	sort.Strings(out)
	return out
}

// UnknownCodeError reports codes that name no check.
type UnknownCodeError struct{ Codes []string }

func (e *UnknownCodeError) Error() string {
	return fmt.Sprintf("unknown finding code(s) %s; known: %s", strings.Join(e.Codes, ", "), strings.Join(Codes(), ", "))
}

// Doctor runs the checks against one database.
type Doctor struct {
	cfg Config
	db  *pgxpool.Pool
}

// New returns a Doctor reading db. The pool should allow at least two
// connections (db.pooling compares two).
func New(cfg Config, db *pgxpool.Pool) (*Doctor, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if db == nil {
		return nil, errors.New("doctor: nil database pool")
	}
	return &Doctor{cfg: cfg, db: db}, nil
}

// Run runs the checks named by codes (every check when empty) one after the
// other and returns their findings ordered by code. It fails only when codes
// holds an unknown code (*UnknownCodeError) or the database cannot be
// reached at all; a check that fails is reported as unchecked.
func (d *Doctor) Run(ctx context.Context, codes []string) (Report, error) {
	want, err := selectCodes(codes)
	if err != nil {
		return Report{}, err
	}
	var rep Report
	if rep.CheckedAt, err = d.now(ctx); err != nil {
		return Report{}, fmt.Errorf("read the database clock: %w", err)
	}
	for _, code := range want {
		rep.Findings = append(rep.Findings, d.runOne(ctx, code))
	}
	return rep, nil
}

func selectCodes(codes []string) ([]string, error) {
	if len(codes) == 0 {
		return Codes(), nil
	}
	var want, unknown []string
	for _, c := range codes {
		c = strings.TrimSpace(c)
		if c == "" {
			continue
		}
		if _, ok := checks[c]; !ok {
			unknown = append(unknown, c)
			continue
		}
		if !slices.Contains(want, c) {
			want = append(want, c)
		}
	}
	if len(unknown) > 0 {
		return nil, &UnknownCodeError{Codes: unknown}
	}
	sort.Strings(want)
	if len(want) == 0 {
		return Codes(), nil
	}
	return want, nil
}

// now is compute_now(), or the server clock when the schema (and with it
// compute_now) is missing: db.migrations then says so.
func (d *Doctor) now(ctx context.Context) (time.Time, error) {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.CheckTimeout)
	defer cancel()
	var t time.Time
	err := d.db.QueryRow(ctx, "SELECT compute_now()").Scan(&t)
	if isCode(err, "42883") {
		err = d.db.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&t)
	}
	return t, err
}

func (d *Doctor) runOne(ctx context.Context, code string) (f Finding) {
	ctx, cancel := context.WithTimeout(ctx, 3*d.cfg.CheckTimeout)
	defer cancel()
	defer func() {
		if r := recover(); r != nil {
			f = Finding{Code: code, Severity: SeverityUnknown, Reason: fmt.Sprintf("check panicked: %v", r)}
		}
	}()
	f, err := checks[code](ctx, d)
	if err != nil {
		return Finding{Code: code, Severity: SeverityUnknown, Summary: "not checked: " + firstLine(uncheckedReason(err, d.cfg.CheckTimeout)),
			Reason: uncheckedReason(err, d.cfg.CheckTimeout), Hint: uncheckedHint(err)}
	}
	f.Code = code
	if !f.Checked && f.Severity != SeverityUnknown {
		f.Checked = true
	}
	if f.Evidence == nil {
		f.Evidence = []Evidence{}
	}
	return f
}

func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}

// uncheckedReason explains why a check could not run.
func uncheckedReason(err error, timeout time.Duration) string {
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "42501":
		return "permission denied: " + pgErr.Message
	case errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "42703" || pgErr.Code == "42883"):
		return "the schema lacks what this check reads (" + pgErr.Message + "): the database is not migrated or the server is too old"
	case errors.As(err, &pgErr) && pgErr.Code == "57014", errors.Is(err, context.DeadlineExceeded):
		return fmt.Sprintf("timed out after --check-timeout %s", timeout)
	}
	return err.Error()
}

func uncheckedHint(err error) string {
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "42501":
		return "grant the doctor's role SELECT on leasehold's tables and membership in pg_monitor (docs/doctor.md, read-only role)"
	case errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "42703" || pgErr.Code == "42883"):
		return "apply the migrations (see db.migrations) or upgrade PostgreSQL (see db.version)"
	}
	return ""
}

func isCode(err error, code string) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == code
}

// read runs fn in a read-only, repeatable-read transaction (one snapshot per
// check) with the check timeout as its statement timeout. It is safe behind
// a transaction pooler: the setting is local to the transaction.
func (d *Doctor) read(ctx context.Context, fn func(tx pgx.Tx) error) error {
	return pgx.BeginTxFunc(ctx, d.db, pgx.TxOptions{AccessMode: pgx.ReadOnly, IsoLevel: pgx.RepeatableRead}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT set_config('statement_timeout', $1, true)", fmt.Sprint(d.cfg.CheckTimeout.Milliseconds())); err != nil {
			return fmt.Errorf("set statement timeout: %w", err)
		}
		return fn(tx)
	})
}

// ok, warn and critical build checked findings.
func ok(summary string) Finding {
	return Finding{Severity: SeverityOK, Summary: summary, Checked: true}
}

func warn(summary, hint string) Finding {
	return Finding{Severity: SeverityWarn, Summary: summary, Hint: hint, Checked: true}
}

func critical(summary, hint string) Finding {
	return Finding{Severity: SeverityCritical, Summary: summary, Hint: hint, Checked: true}
}

// unchecked builds a finding for a check that ran but could not conclude.
func unchecked(reason, hint string) Finding {
	return Finding{Severity: SeverityUnknown, Summary: "not checked: " + reason, Reason: reason, Hint: hint}
}

// dur formats an age for people: whole seconds from a second up, else ms.
func dur(d time.Duration) string {
	if d < 0 {
		return "-" + dur(-d)
	}
	if d >= time.Second {
		return d.Round(time.Second).String()
	}
	return d.Round(time.Millisecond).String()
}

// plural returns "1 key" / "2 keys".
func plural(n int, one, many string) string {
	if n == 1 {
		return fmt.Sprintf("%d %s", n, one)
	}
	return fmt.Sprintf("%d %s", n, many)
}

// capped adds at most maxEvidenceRows rows of key to f, then one "more" row.
func capped[T any](f *Finding, key string, rows []T, format func(T) string) {
	for i, r := range rows {
		if i == maxEvidenceRows {
			f.add(key, "… and %d more", len(rows)-maxEvidenceRows)
			return
		}
		f.add(key, "%s", format(r))
	}
}
