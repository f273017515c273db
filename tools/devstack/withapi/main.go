// Command withapi runs one command against a throwaway leasehold-api: it
// starts a PostgreSQL cluster in a temporary directory on a free port (from
// the machine's own binaries, as pkg/pglocal does for the tests), starts
// bin/leasehold-api on it with --migrate, a free listen port and two fresh
// random tokens (admin and viewer), waits for /readyz, and runs the command
// with the api's address and tokens in its environment:
//
//	LEASEHOLD_API_URL       http://127.0.0.1:<port>
//	LEASEHOLD_ADMIN_TOKEN   an admin token of that api
//	LEASEHOLD_VIEWER_TOKEN  a viewer token of that api
//
// It exits with the command's status, after stopping the api (SIGTERM) and
// the cluster and removing the directory. `make test-ts` runs the TypeScript
// client's test through it:
//
//	go run ./tools/devstack/withapi -bin bin -- npm --prefix clients/ts test
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/leasehold/leasehold/pkg/pglocal"
)

func main() {
	bin := flag.String("bin", "bin", "directory holding leasehold-api (make build)")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: withapi [-bin DIR] -- COMMAND [ARG...]\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, nil))
	code, err := run(logger, *bin, flag.Args())
	if err != nil {
		logger.Error("withapi failed", "err", err)
		os.Exit(1)
	}
	os.Exit(code)
}

// run returns the command's exit status, or an error when the stack could
// not be started.
func run(logger *slog.Logger, bin string, command []string) (int, error) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	dir, err := os.MkdirTemp("", "leasehold-withapi-")
	if err != nil {
		return 0, fmt.Errorf("temporary directory: %w", err)
	}
	defer os.RemoveAll(dir)
	// As root, PostgreSQL runs as an unprivileged user (pglocal), which must
	// traverse this directory; MkdirTemp makes it 0700.
	if err := os.Chmod(dir, 0o755); err != nil {
		return 0, fmt.Errorf("temporary directory: %w", err)
	}

	cluster, err := pglocal.New(ctx, pglocal.Options{Dir: filepath.Join(dir, "pg")})
	if err != nil {
		return 0, fmt.Errorf("PostgreSQL cluster: %w", err)
	}
	if err := cluster.Start(ctx); err != nil {
		return 0, fmt.Errorf("start PostgreSQL (log %s): %w", cluster.LogFile(), err)
	}
	defer func() { _ = cluster.Stop(context.Background(), pglocal.StopFast) }()
	logger.Info("PostgreSQL started", "port", cluster.Port())

	adminToken, viewerToken := token(), token()
	listen, health, err := twoFreePorts()
	if err != nil {
		return 0, err
	}
	apiURL := "http://127.0.0.1:" + strconv.Itoa(listen)
	api := exec.Command(filepath.Join(bin, "leasehold-api"), "--migrate", "--log-format", "text",
		"--listen-addr", "127.0.0.1:"+strconv.Itoa(listen), "--http-addr", "127.0.0.1:"+strconv.Itoa(health))
	api.Env = append(os.Environ(), "LEASEHOLD_DATABASE_URL="+cluster.URL("postgres"),
		"LEASEHOLD_API_TOKENS=admin:"+adminToken+",viewer:"+viewerToken)
	api.Stdout, api.Stderr = os.Stderr, os.Stderr
	if err := api.Start(); err != nil {
		return 0, fmt.Errorf("start %s (run `make build` first): %w", api.Path, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- api.Wait() }()
	defer func() {
		_ = api.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			_ = api.Process.Kill()
			<-exited
		}
	}()
	if err := waitReady(ctx, "http://127.0.0.1:"+strconv.Itoa(health)+"/readyz", exited); err != nil {
		return 0, err
	}
	logger.Info("leasehold-api ready", "url", apiURL)

	cmd := exec.CommandContext(ctx, command[0], command[1:]...)
	cmd.Env = append(os.Environ(), "LEASEHOLD_API_URL="+apiURL,
		"LEASEHOLD_ADMIN_TOKEN="+adminToken, "LEASEHOLD_VIEWER_TOKEN="+viewerToken)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	err = cmd.Run()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return 0, nil
	case errors.As(err, &exit):
		return exit.ExitCode(), nil
	default:
		return 0, fmt.Errorf("run %q: %w", command[0], err)
	}
}

// token returns 24 random bytes in hex, the form `openssl rand -hex 24` gives.
func token() string {
	b := make([]byte, 24)
	_, _ = rand.Read(b) // crypto/rand.Read never fails (Go 1.24+)
	return hex.EncodeToString(b)
}

func twoFreePorts() (int, int, error) {
	a, err := pglocal.FreePort()
	if err != nil {
		return 0, 0, fmt.Errorf("free port: %w", err)
	}
	for range 10 {
		b, err := pglocal.FreePort()
		if err != nil {
			return 0, 0, fmt.Errorf("free port: %w", err)
		}
		if b != a {
			return a, b, nil
		}
	}
	return 0, 0, errors.New("free port: got the same port ten times")
}

// waitReady polls url until it answers 200, the api exits, or 60 s pass.
func waitReady(ctx context.Context, url string, exited <-chan error) error {
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := http.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("leasehold-api not ready at %s after 60s", url)
		}
		select {
		case err := <-exited:
			return fmt.Errorf("leasehold-api exited before it was ready: %w", err)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}
