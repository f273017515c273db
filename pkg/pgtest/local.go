package pgtest

import (
	"context"
	"fmt"
	"os"

	"github.com/leasehold/leasehold/pkg/pglocal"
)

type localRestarter struct{ c *pglocal.Cluster }

func (l localRestarter) Restart(ctx context.Context, immediate bool) error {
	mode := pglocal.StopFast
	if immediate {
		mode = pglocal.StopImmediate
	}
	return l.c.Restart(ctx, mode)
}

func (l localRestarter) Stop(ctx context.Context) error { return l.c.Stop(ctx, pglocal.StopFast) }

func (l localRestarter) Start(ctx context.Context) error {
	if l.c.Running(ctx) {
		return nil
	}
	return l.c.Start(ctx)
}

func startLocal(ctx context.Context) (*server, error) {
	dir, err := os.MkdirTemp("", "leasehold-pgtest-")
	if err != nil {
		return nil, fmt.Errorf("temp dir: %w", err)
	}
	c, err := pglocal.New(ctx, pglocal.Options{Dir: dir})
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if err := c.Start(ctx); err != nil {
		_ = c.Remove(context.Background())
		return nil, err
	}
	return &server{
		adminURL: c.URL("postgres"),
		stop:     func() { _ = c.Remove(context.Background()) },
		local:    localRestarter{c},
	}, nil
}
