package pgbouncer

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"

	"github.com/jackc/pgx/v5/pgconn"
)

func (b *Bouncer) iniPath() string      { return filepath.Join(b.dir, "pgbouncer.ini") }
func (b *Bouncer) userlistPath() string { return filepath.Join(b.dir, "userlist.txt") }

// Server is the host and port the [databases] entry points at now.
func (b *Bouncer) Server() (host string, port int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.opts.ServerHost, b.opts.ServerPort
}

// Repoint rewrites the [databases] entry to host:port and makes PgBouncer
// RELOAD it through its admin console: what an operator (or Patroni's
// callback, or a managed database's DNS) does after a failover so clients
// keep their PgBouncer address. Client connections stay open; PgBouncer
// closes the server connections to the old address as they come free and
// opens new ones to the new address, so a transaction-mode client's next
// transaction runs on the new primary.
func (b *Bouncer) Repoint(ctx context.Context, host string, port int) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.opts.ServerHost, b.opts.ServerPort = host, port
	// Rewrite in place: the file keeps its owner (PgBouncer's user).
	if err := os.WriteFile(b.iniPath(), []byte(b.config(b.userlistPath())), 0o600); err != nil {
		return fmt.Errorf("pgbouncer: rewrite config: %w", err)
	}
	if err := b.Admin(ctx, "RELOAD"); err != nil {
		return fmt.Errorf("pgbouncer: reload after repointing to %s:%d: %w", host, port, err)
	}
	return nil
}

// Admin runs one command (RELOAD, PAUSE, RESUME, SHOW ...) on PgBouncer's
// admin console, the virtual "pgbouncer" database, as the configured user
// (an admin_users entry), with the simple protocol the console requires.
func (b *Bouncer) Admin(ctx context.Context, command string) error {
	u := url.URL{Scheme: "postgres", User: url.UserPassword(b.opts.User, b.opts.Password), Host: b.Addr(), Path: "/pgbouncer",
		RawQuery: "sslmode=disable"}
	conn, err := pgconn.Connect(ctx, u.String())
	if err != nil {
		return fmt.Errorf("admin console: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, command).ReadAll(); err != nil {
		return fmt.Errorf("admin console %s: %w", command, err)
	}
	return nil
}
