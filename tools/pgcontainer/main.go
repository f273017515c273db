// Command pgcontainer runs a command against a PostgreSQL in a Docker
// container: it starts postgres (through ory/dockertest), waits until it
// accepts connections, runs the command with LEASEHOLD_TEST_DATABASE_URL set
// to the container's superuser URL (pkg/pgtest's first source), and removes
// the container when the command ends or the tool is interrupted.
//
//	GOWORK=off go -C tools/pgcontainer run . -- make -C ../.. test
//
// It is a module of its own, outside go.work, so dockertest and through it
// docker's and runc's modules are required by no module a service builds
// from. pgtest's own fallback, with no URL set, is a throwaway cluster from
// the local initdb and pg_ctl.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/ory/dockertest/v3"
	"github.com/ory/dockertest/v3/docker"
)

// envURL is pkg/pgtest's EnvURL, spelled out so this module needs nothing
// from the workspace.
const envURL = "LEASEHOLD_TEST_DATABASE_URL"

func main() {
	tag := flag.String("tag", "16", "tag of the postgres image")
	wait := flag.Duration("wait", 90*time.Second, "how long to wait for the container to accept connections")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: pgcontainer [-tag T] [-wait D] -- command [args...]\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}
	code, err := run(*tag, *wait, flag.Args())
	if err != nil {
		slog.Error("pgcontainer", "err", err)
		os.Exit(1)
	}
	os.Exit(code)
}

// run starts the container, runs argv with the URL in its environment and
// returns its exit code; the container is purged on every path.
func run(tag string, wait time.Duration, argv []string) (int, error) {
	pool, err := dockertest.NewPool("")
	if err != nil {
		return 0, fmt.Errorf("docker engine: %w", err)
	}
	if err := pool.Client.Ping(); err != nil {
		return 0, fmt.Errorf("docker engine does not answer (docker info; DOCKER_HOST): %w", err)
	}
	res, err := pool.RunWithOptions(&dockertest.RunOptions{
		Repository: "postgres",
		Tag:        tag,
		Env:        []string{"POSTGRES_PASSWORD=postgres", "POSTGRES_DB=postgres"},
		Cmd:        []string{"postgres", "-c", "fsync=off", "-c", "max_connections=400"},
	}, func(hc *docker.HostConfig) {
		hc.AutoRemove = true
		hc.RestartPolicy = docker.RestartPolicy{Name: "no"}
	})
	if err != nil {
		return 0, fmt.Errorf("run postgres:%s: %w", tag, err)
	}
	// No res.Expire: its argument is the grace before SIGKILL, not a
	// lifetime, so it would stop the container at once.
	defer func() {
		if err := pool.Purge(res); err != nil {
			slog.Warn("purge container", "id", res.Container.ID, "err", err)
		}
	}()
	u := fmt.Sprintf("postgres://postgres:postgres@%s/postgres?sslmode=disable", res.GetHostPort("5432/tcp"))
	pool.MaxWait = wait
	if err := pool.Retry(func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, u)
		if err != nil {
			return err
		}
		return conn.Close(ctx)
	}); err != nil {
		return 0, fmt.Errorf("wait for postgres:%s: %w", tag, err)
	}
	slog.Info("postgres is up", "container", res.Container.ID[:12], envURL, u)

	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = append(os.Environ(), envURL+"="+u)
	if err := cmd.Start(); err != nil {
		return 0, fmt.Errorf("start %s: %w", argv[0], err)
	}
	// Forward an interrupt to the command and still purge after it ends.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sigs)
	go func() {
		for s := range sigs {
			_ = cmd.Process.Signal(s)
		}
	}()
	err = cmd.Wait()
	if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
		return ee.ExitCode(), nil
	}
	if err != nil {
		return 0, fmt.Errorf("wait for %s: %w", argv[0], err)
	}
	return 0, nil
}
