package main

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/leasehold/leasehold/bench/internal/harness"
	"github.com/leasehold/leasehold/pkg/netns"
)

// The vanish scenario: the victim worker runs in a network namespace and
// reaches PostgreSQL over a veth link, which is then cut (the host end goes
// down), so every packet between them is lost without a FIN or an RST, as
// when a host loses power. A loopback fault proxy cannot do this: its own
// connection to the server stays up. The server notices the victim's
// liveness session gone through that session's keepalives and
// tcp_user_timeout; the survivor (on the host) then releases and takes the
// victim's leases. Each run starts a new victim in the same namespace next
// to the survivor, so like the other scenarios it moves the victim's share.

// vanishNamespace makes the namespace before the server starts: the server
// must listen on its link.
func (b *bench) vanishNamespace(ctx context.Context) (*netns.Namespace, error) {
	if os.Getenv("LEASEHOLD_DATABASE_URL") != "" {
		return nil, fmt.Errorf("the server comes from LEASEHOLD_DATABASE_URL and cannot be made to listen on the namespace's link")
	}
	if err := netns.Available(); err != nil {
		return nil, err
	}
	return netns.New(ctx, 30+os.Getpid()%200)
}

func (b *bench) vanish(ctx context.Context) (*scenarioResult, error) {
	logf("leasehold vanish: %d runs (namespace %s, link %s)", b.c.runs, b.ns.Name, b.ns.Subnet)
	u, err := url.Parse(b.lh.URL)
	if err != nil {
		return nil, err
	}
	u.Host = b.ns.HostAddr + ":" + u.Port()
	victimURL := u.String()

	survivor, sid, err := b.startWorker(ctx)
	if err != nil {
		return nil, err
	}
	if err := waitFor(ctx, 60*time.Second, func() bool { h, _ := b.held(ctx, sid); return shards(h) == 256 }); err != nil {
		return nil, fmt.Errorf("survivor never held 256 shards: %w", err)
	}
	sr := &scenarioResult{}
	for i := range b.c.runs {
		b.seq++
		vid := fmt.Sprintf("w%d", b.seq)
		_, port, _ := strings.Cut(harness.FreeAddr(), ":")
		bin, args := b.ns.Command(b.worker, "--database-url", victimURL, "--http-addr", b.ns.NSAddr+":"+port, "--id", vid,
			"--log-format", "text", "--log-level", "warn")
		victim, err := b.sup.Start(vid, bin, nil, args...)
		if err != nil {
			return nil, err
		}
		if err := victim.WaitReady(ctx, 60*time.Second); err != nil {
			return nil, err
		}
		victimHeld, err := b.settle(ctx, vid, sid)
		if err != nil {
			return nil, err
		}
		sr.LeasesMoved = append(sr.LeasesMoved, len(victimHeld))
		t0 := time.Now()
		if err := b.ns.Vanish(ctx); err != nil {
			return nil, err
		}
		var took, noticed time.Duration
		err = waitForFast(ctx, 60*time.Second, func() bool {
			if noticed == 0 {
				var n int
				if err := b.lh.Pool.QueryRow(ctx, `SELECT count(*) /*bench*/ FROM pg_stat_activity WHERE application_name = $1`,
					"leasehold-liveness:"+vid).Scan(&n); err == nil && n == 0 {
					noticed = time.Since(t0)
				}
			}
			h, err := b.held(ctx, sid)
			if err != nil {
				return false
			}
			for n := range victimHeld {
				if !h[n] {
					return false
				}
			}
			took = time.Since(t0)
			return true
		})
		if err != nil {
			return nil, fmt.Errorf("run %d: %s never took %d leases over: %w", i+1, sid, len(victimHeld), err)
		}
		sr.Takeovers = append(sr.Takeovers, took)
		sr.Noticed = append(sr.Noticed, noticed)
		logf("leasehold vanish run %d/%d: the server ended %s's liveness session %s after the cut; %s held its %d leases (%d shards) after %s",
			i+1, b.c.runs, vid, noticed.Round(time.Millisecond), sid, len(victimHeld), shards(victimHeld), took.Round(time.Millisecond))
		// Bench hygiene: the victim is killed while cut off, so the server
		// never hears of its other sessions; end them, forget the member,
		// and bring the link back for the next run.
		victim.Kill()
		if _, err := b.lh.Pool.Exec(ctx, `SELECT pg_terminate_backend(pid) /*bench*/ FROM pg_stat_activity
			WHERE application_name LIKE '%' || $1 AND pid <> pg_backend_pid()`, ":"+vid); err != nil {
			return nil, err
		}
		if _, err := b.lh.Pool.Exec(ctx, `DELETE FROM workers WHERE id = $1 /*bench*/`, vid); err != nil {
			return nil, err
		}
		if err := b.ns.Restore(ctx); err != nil {
			return nil, err
		}
	}
	_ = survivor.Signal(syscall.SIGTERM)
	if _, ok := survivor.Wait(60 * time.Second); !ok {
		survivor.Kill()
	}
	if _, err := b.lh.Pool.Exec(ctx, `DELETE FROM workers /*bench*/`); err != nil {
		return nil, err
	}
	sr.Dist = harness.Summarize(sr.Takeovers)
	sr.NoticeDist = harness.Summarize(sr.Noticed)
	return sr, nil
}
