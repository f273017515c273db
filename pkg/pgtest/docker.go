package pgtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/ory/dockertest/v3"
	"github.com/ory/dockertest/v3/docker"
)

var errNoDocker = errors.New("no docker engine")

// startDocker runs postgres in a container when a Docker engine answers a
// ping; errNoDocker otherwise, so the caller falls back to local binaries.
// CI has no engine, so no CI run reaches past the first return: the package
// documentation says how to exercise it by hand.
func startDocker(ctx context.Context) (*server, error) {
	if os.Getenv("DOCKER_HOST") == "" {
		if _, err := os.Stat("/var/run/docker.sock"); err != nil {
			return nil, errNoDocker
		}
	}
	pool, err := dockertest.NewPool("")
	if err != nil {
		return nil, errNoDocker
	}
	if err := pool.Client.Ping(); err != nil {
		return nil, errNoDocker
	}
	res, err := pool.RunWithOptions(&dockertest.RunOptions{
		Repository: "postgres",
		Tag:        "16",
		Env:        []string{"POSTGRES_PASSWORD=postgres", "POSTGRES_DB=postgres"},
		Cmd:        []string{"postgres", "-c", "fsync=off", "-c", "max_connections=400"},
	}, func(hc *docker.HostConfig) {
		hc.AutoRemove = true
		hc.RestartPolicy = docker.RestartPolicy{Name: "no"}
	})
	if err != nil {
		return nil, fmt.Errorf("run postgres container: %w", err)
	}
	// No res.Expire: dockertest's Expire stops the container at once (its
	// argument is the grace before SIGKILL, not a lifetime). A test binary
	// that crashes leaves the container running until `docker rm -f`; one
	// that ends purges it, and AutoRemove deletes it once stopped.
	u := fmt.Sprintf("postgres://postgres:postgres@%s/postgres?sslmode=disable", res.GetHostPort("5432/tcp"))
	pool.MaxWait = 90 * time.Second
	if err := pool.Retry(func() error {
		conn, err := pgx.Connect(ctx, u)
		if err != nil {
			return err
		}
		return conn.Close(ctx)
	}); err != nil {
		_ = pool.Purge(res)
		return nil, fmt.Errorf("wait for postgres container: %w", err)
	}
	return &server{adminURL: u, stop: func() { _ = pool.Purge(res) }}, nil
}
