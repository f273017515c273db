// Package pgnotify keeps one LISTEN session on PostgreSQL: it connects,
// listens on every channel it has a handler for, calls each notification's
// handler, and reconnects after any error, calling OnConnect every time the
// session is (re)established so the caller can catch up on what it missed.
//
// LISTEN needs a session of its own, so the URL must reach PostgreSQL
// directly, never through a transaction pooler.
package pgnotify

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jonboulle/clockwork"
)

// DefaultReconnectDelay is the wait between a lost session and the next
// attempt when Config.ReconnectDelay is zero.
const DefaultReconnectDelay = time.Second

// connectTimeout bounds one connection attempt, so an unreachable database
// cannot hold the listener in a dial.
const connectTimeout = 5 * time.Second

// Config describes one LISTEN session.
type Config struct {
	// URL is a direct connection URL (not through a pooler).
	URL string
	// Handlers maps each channel to listen on to the function called, on the
	// listener's goroutine, with the payload of each notification on it.
	Handlers map[string]func(payload string)
	// OnConnect, if set, runs after every (re)connect once LISTEN is in
	// place on every channel: notifications sent while the session was down
	// are lost, so this is where the caller catches up.
	OnConnect func()
	// OnLost, if set, runs when an established or attempted session fails,
	// before the reconnect delay; it never runs because ctx ended.
	OnLost func(err error)
	// ReconnectDelay is the wait before reconnecting (DefaultReconnectDelay
	// when zero), measured on Clock.
	ReconnectDelay time.Duration
	// Clock defaults to the real clock.
	Clock clockwork.Clock
}

// Listen runs the session until ctx ends, reconnecting after every error.
// It returns only when ctx is done, and an error only for a Config that
// cannot work (no URL, no handler).
func Listen(ctx context.Context, cfg Config) error {
	if cfg.URL == "" {
		return errors.New("pgnotify: no URL to LISTEN on")
	}
	if len(cfg.Handlers) == 0 {
		return errors.New("pgnotify: no channel to LISTEN on")
	}
	if cfg.ReconnectDelay <= 0 {
		cfg.ReconnectDelay = DefaultReconnectDelay
	}
	if cfg.Clock == nil {
		cfg.Clock = clockwork.NewRealClock()
	}
	for ctx.Err() == nil {
		err := session(ctx, cfg)
		if ctx.Err() != nil {
			return nil
		}
		if cfg.OnLost != nil {
			cfg.OnLost(err)
		}
		select {
		case <-ctx.Done():
		case <-cfg.Clock.After(cfg.ReconnectDelay):
		}
	}
	return nil
}

// session is one connection: LISTEN on every channel, OnConnect, then
// dispatch notifications until the connection or ctx fails.
func session(ctx context.Context, cfg Config) error {
	cctx, cancel := context.WithTimeout(ctx, connectTimeout)
	conn, err := pgx.Connect(cctx, cfg.URL)
	cancel()
	if err != nil {
		return fmt.Errorf("connect for LISTEN: %w", err)
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	for ch := range cfg.Handlers {
		if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{ch}.Sanitize()); err != nil {
			return fmt.Errorf("LISTEN %s: %w", ch, err)
		}
	}
	if cfg.OnConnect != nil {
		cfg.OnConnect()
	}
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return fmt.Errorf("wait for notification: %w", err)
		}
		if h := cfg.Handlers[n.Channel]; h != nil {
			h(n.Payload)
		}
	}
}
