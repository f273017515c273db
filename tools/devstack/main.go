// Command devstack starts leasehold on its embedded default for development:
// a PostgreSQL cluster under .dev/ built from the machine's own PostgreSQL
// binaries (unless LEASEHOLD_DATABASE_URL is set), migrated, and every
// service as a child process with its health endpoints on loopback. Ctrl-C
// stops the services (SIGTERM, so they release their leases) and the cluster.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/migrations"
	"github.com/leasehold/leasehold/pkg/pglocal"
)

type service struct {
	name string
	addr string
}

var stack = []service{
	{"worker", "127.0.0.1:9101"},
	{"scheduler", "127.0.0.1:9102"},
	{"gateway", "127.0.0.1:9103"},
	{"api", "127.0.0.1:9104"},
}

const devToken = "dev-health-token"

// apiToken is the development admin token of the api (never use it elsewhere).
const apiToken = "dev-admin-token-change-me"

func main() {
	var (
		dir         = flag.String("dir", ".dev", "directory of the development cluster")
		bin         = flag.String("bin", "bin", "directory of the built service binaries")
		migrateOnly = flag.Bool("migrate-only", false, "start the database, apply migrations and exit (the cluster keeps running)")
		stopOnly    = flag.Bool("stop", false, "stop the development cluster and exit")
		keepDB      = flag.Bool("keep-db", false, "leave the development cluster running on exit")
		exitAfter   = flag.Duration("exit-after", 0, "stop by itself once everything is ready and this long has passed (0: run until Ctrl-C)")
	)
	flag.Parse()
	logger := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if err := run(logger, *dir, *bin, *migrateOnly, *stopOnly, *keepDB, *exitAfter); err != nil {
		logger.Error("devstack failed", "err", err)
		os.Exit(1)
	}
}

func run(logger *slog.Logger, dir, bin string, migrateOnly, stopOnly, keepDB bool, exitAfter time.Duration) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	url := os.Getenv("LEASEHOLD_DATABASE_URL")
	var cluster *pglocal.Cluster
	if url == "" {
		c, err := pglocal.New(ctx, pglocal.Options{Dir: filepath.Join(dir, "pg"), Port: 55432, Durable: true})
		if err != nil {
			return err
		}
		cluster = c
		if stopOnly {
			return c.Stop(context.Background(), pglocal.StopFast)
		}
		logger.Info("starting PostgreSQL", "dir", c.DataDir(), "port", c.Port())
		if err := c.Start(ctx); err != nil {
			return err
		}
		if err := ensureDB(ctx, c.URL("postgres"), "leasehold"); err != nil {
			return err
		}
		url = c.URL("leasehold")
	} else if stopOnly {
		return nil
	}
	st, err := migrations.UpURL(ctx, url, logger)
	if err != nil {
		return err
	}
	logger.Info("database ready", "url", redact(url), "schema_version", st.Current)
	if migrateOnly {
		fmt.Printf("LEASEHOLD_DATABASE_URL=%s\n", url)
		return nil
	}
	if cluster != nil && !keepDB {
		defer func() {
			logger.Info("stopping PostgreSQL")
			_ = cluster.Stop(context.Background(), pglocal.StopFast)
		}()
	}
	return runServices(ctx, logger, bin, url, exitAfter)
}

func runServices(ctx context.Context, logger *slog.Logger, bin, url string, exitAfter time.Duration) error {
	var cmds []*exec.Cmd
	exited := make(chan string, len(stack))
	for _, s := range stack {
		path := filepath.Join(bin, "leasehold-"+s.name)
		cmd := exec.Command(path, "--http-addr", s.addr, "--log-format", "text")
		cmd.Env = append(os.Environ(), "LEASEHOLD_DATABASE_URL="+url, "LEASEHOLD_HEALTH_TOKEN="+devToken,
			"LEASEHOLD_API_TOKENS=admin:"+apiToken)
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		if err := cmd.Start(); err != nil {
			terminate(cmds)
			return fmt.Errorf("start %s (run `make build` first): %w", path, err)
		}
		cmds = append(cmds, cmd)
		go func(name string) { _ = cmd.Wait(); exited <- name }(s.name)
	}
	defer terminate(cmds)

	if err := waitReady(ctx); err != nil {
		return err
	}
	fmt.Println()
	fmt.Println("leasehold is running. Endpoints:")
	for _, s := range stack {
		fmt.Printf("  %-10s http://%s/readyz  /livez  /metrics  /healthz/detail (Authorization: Bearer %s)\n", s.name, s.addr, devToken)
	}
	fmt.Printf("  database   %s\n", redact(url))
	fmt.Printf("  nodes      connect to the gateway at http://127.0.0.1:9443 (h2c)\n")
	fmt.Printf("\nTry the api (admin token %q):\n", apiToken)
	fmt.Printf("  curl -s -H 'Authorization: Bearer %s' -H 'Content-Type: application/json' -d '{}' \\\n"+
		"    http://127.0.0.1:8080/leasehold.control.v1.ControlService/ListWorkers\n", apiToken)
	fmt.Printf("  bin/leasehold-doctor check --database-url '%s'\n\nPress Ctrl-C to stop.\n", url)

	var timeout <-chan time.Time
	if exitAfter > 0 {
		timeout = time.After(exitAfter)
	}
	select {
	case <-ctx.Done():
		return nil
	case <-timeout:
		return nil
	case name := <-exited:
		return fmt.Errorf("%s exited unexpectedly", name)
	}
}

// terminate sends SIGTERM (so services release their leases) and waits.
func terminate(cmds []*exec.Cmd) {
	for _, c := range cmds {
		if c.Process != nil {
			_ = c.Process.Signal(syscall.SIGTERM)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for _, c := range cmds {
		for c.ProcessState == nil && time.Now().Before(deadline) {
			if err := c.Process.Signal(syscall.Signal(0)); err != nil {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}

func waitReady(ctx context.Context) error {
	deadline := time.Now().Add(60 * time.Second)
	for _, s := range stack {
		for {
			resp, err := http.Get("http://" + s.addr + "/readyz")
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					break
				}
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("%s not ready at http://%s/readyz after 60s", s.name, s.addr)
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
	return nil
}

func ensureDB(ctx context.Context, adminURL, name string) error {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return fmt.Errorf("connect to dev cluster: %w", err)
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	if err != nil && !strings.Contains(err.Error(), "already exists") {
		return fmt.Errorf("create database %s: %w", name, err)
	}
	return nil
}

func redact(url string) string {
	if i := strings.Index(url, "://"); i >= 0 {
		if at := strings.Index(url[i+3:], "@"); at >= 0 {
			cred := url[i+3 : i+3+at]
			if c := strings.Index(cred, ":"); c >= 0 {
				return url[:i+3] + cred[:c] + ":***" + url[i+3+at:]
			}
		}
	}
	return url
}
