// Command devstack starts leasehold on its embedded default for development:
// a PostgreSQL cluster under .dev/ built from the machine's own PostgreSQL
// binaries (unless LEASEHOLD_DATABASE_URL is set), migrated, and every
// service as a child process with its health endpoints on loopback.
//
// Ports: the documented defaults (PostgreSQL 55432, health 9101-9104, api
// 8080, gateway 9443) when free, a free port in place of a busy default (it
// says so), or the ports given with flags or LEASEHOLD_DEV_* variables
// (which must be free: a busy one is refused with its number).
//
// A service that exits is restarted after a back-off (1 s doubling to 30 s,
// back to 1 s once it stayed up a minute), and the log says so. Ctrl-C or
// SIGTERM stops the services (SIGTERM, so they release their leases), then
// the cluster, and exits 0.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/migrations"
	"github.com/leasehold/leasehold/pkg/lifecycle"
	"github.com/leasehold/leasehold/pkg/pglocal"
)

const devToken = "dev-health-token"

// apiToken is the development admin token of the api (never use it elsewhere).
const apiToken = "dev-admin-token-change-me"

// relayToken is the development token of the gateway's tunnel relay, written
// to a temporary file (removed on exit) for the gateway and the api (never
// use it elsewhere).
const relayToken = "dev-relay-token-change-me"

// options are devstack's flags.
type options struct {
	dir, bin                      string
	migrateOnly, stopOnly, keepDB bool
	exitAfter                     time.Duration
	restart                       restartPolicy
	pgPort, apiPort, gatewayPort  portFlag
	healthBase                    portFlag
}

func main() {
	o := options{
		pgPort:      portFlag{what: "PostgreSQL", flag: "pg-port", env: "LEASEHOLD_DEV_PG_PORT", def: 55432},
		apiPort:     portFlag{what: "the api (ControlService)", flag: "api-port", env: "LEASEHOLD_DEV_API_PORT", def: 8080},
		gatewayPort: portFlag{what: "the gateway (node streams)", flag: "gateway-port", env: "LEASEHOLD_DEV_GATEWAY_PORT", def: 9443},
		healthBase:  portFlag{what: "the health endpoints (worker, scheduler, gateway, api: base+0..3)", flag: "health-port-base", env: "LEASEHOLD_DEV_HEALTH_PORT_BASE", def: 9101},
	}
	flag.StringVar(&o.dir, "dir", ".dev", "directory of the development cluster")
	flag.StringVar(&o.bin, "bin", "bin", "directory of the built service binaries")
	flag.BoolVar(&o.migrateOnly, "migrate-only", false, "start the database, apply migrations and exit (the cluster keeps running)")
	flag.BoolVar(&o.stopOnly, "stop", false, "stop the development cluster and exit")
	flag.BoolVar(&o.keepDB, "keep-db", false, "leave the development cluster running on exit")
	flag.DurationVar(&o.exitAfter, "exit-after", 0, "stop by itself once everything is ready and this long has passed (0: run until Ctrl-C)")
	flag.DurationVar(&o.restart.Min, "restart-backoff", time.Second, "delay before restarting a service that exited; doubles at each exit")
	flag.DurationVar(&o.restart.Max, "restart-backoff-max", 30*time.Second, "cap of the restart delay")
	flag.DurationVar(&o.restart.StableAfter, "restart-stable-after", time.Minute, "a service up this long is restarted after -restart-backoff again")
	for _, p := range []*portFlag{&o.pgPort, &o.apiPort, &o.gatewayPort, &o.healthBase} {
		p.register(flag.CommandLine)
	}
	showVersion := lifecycle.RegisterVersionFlag(flag.CommandLine)
	flag.Parse()
	if *showVersion {
		lifecycle.PrintVersion(os.Stdout, "devstack")
		return
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if err := run(logger, o); err != nil {
		logger.Error("devstack failed", "err", err)
		os.Exit(1)
	}
}

func run(logger *slog.Logger, o options) error {
	if o.restart.Min <= 0 || o.restart.Max < o.restart.Min {
		return fmt.Errorf("-restart-backoff %s must be positive and at most -restart-backoff-max %s", o.restart.Min, o.restart.Max)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	picker := &portPicker{taken: map[int]bool{}}

	url := os.Getenv("LEASEHOLD_DATABASE_URL")
	var cluster *pglocal.Cluster
	if url == "" {
		c, err := startCluster(ctx, logger, o, picker)
		if err != nil || o.stopOnly {
			return err
		}
		cluster = c
		if err := ensureDB(ctx, c.URL("postgres"), "leasehold"); err != nil {
			return err
		}
		url = c.URL("leasehold")
	} else if o.stopOnly {
		return nil
	}
	st, err := migrations.UpURL(ctx, url, logger)
	if err != nil {
		return err
	}
	logger.Info("database ready", "url", redact(url), "schema_version", st.Current)
	if o.migrateOnly {
		fmt.Printf("LEASEHOLD_DATABASE_URL=%s\n", url)
		return nil
	}
	if cluster != nil && !o.keepDB {
		defer func() {
			logger.Info("stopping PostgreSQL")
			_ = cluster.Stop(context.Background(), pglocal.StopFast)
		}()
	}
	stack, err := planServices(o, picker)
	if err != nil {
		return err
	}
	base, _ := o.healthBase.explicit()
	if base == 0 {
		base = o.healthBase.def
	}
	nodes, err := planNodes(o, picker, base)
	if err != nil {
		return err
	}
	for _, n := range picker.notes {
		logger.Warn(n)
	}
	return runServices(ctx, logger, o, stack, nodes, url)
}

// startCluster starts (or finds running) the .dev cluster on its port:
// the explicit one, else the one it used last, else 55432, else a free one.
func startCluster(ctx context.Context, logger *slog.Logger, o options, picker *portPicker) (*pglocal.Cluster, error) {
	dir := filepath.Join(o.dir, "pg")
	if o.stopOnly {
		c, err := pglocal.New(ctx, pglocal.Options{Dir: dir, Durable: true}) // the saved port
		if err != nil {
			return nil, err
		}
		return c, c.Stop(context.Background(), pglocal.StopFast)
	}
	explicit, err := o.pgPort.explicit()
	if err != nil {
		return nil, err
	}
	saved := savedPort(dir)
	port := o.pgPort.def
	switch {
	case explicit != 0:
		port = explicit
	case saved != 0:
		port = saved
	}
	c, err := pglocal.New(ctx, pglocal.Options{Dir: dir, Port: port, Durable: true})
	if err != nil {
		return nil, err
	}
	if c.Running(ctx) {
		if explicit != 0 && saved != 0 && explicit != saved {
			return nil, fmt.Errorf("the development cluster in %s is already running on port %d: run `make stop` before moving it to -pg-port %d", dir, saved, explicit)
		}
		picker.taken[c.Port()] = true
		logger.Info("PostgreSQL already running", "dir", c.DataDir(), "port", c.Port())
		return c, nil
	}
	chosen, err := picker.pick(&o.pgPort, port, explicit != 0)
	if err != nil {
		return nil, err
	}
	for _, n := range picker.notes {
		logger.Warn(n)
	}
	picker.notes = nil
	if chosen != port {
		if c, err = pglocal.New(ctx, pglocal.Options{Dir: dir, Port: chosen, Durable: true}); err != nil {
			return nil, err
		}
	}
	logger.Info("starting PostgreSQL", "dir", c.DataDir(), "port", c.Port())
	if err := c.Start(ctx); err != nil {
		return nil, fmt.Errorf("start PostgreSQL on port %d: %w%s", c.Port(), err, logTail(c.LogFile(), 12))
	}
	return c, nil
}

func savedPort(dir string) int {
	b, err := os.ReadFile(filepath.Join(dir, "port"))
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return n
}

// logTail is the last n lines of a log file, for an error message.
func logTail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil || len(b) == 0 {
		return ""
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return "\nlast lines of " + path + ":\n  " + strings.Join(lines, "\n  ")
}

// service is one child of the stack and its addresses.
type service struct {
	name   string
	health string // host:port of /readyz and friends
	listen string // host:port of its service port, if it has one
}

// planServices gives every service its ports.
func planServices(o options, picker *portPicker) ([]service, error) {
	base, err := o.healthBase.explicit()
	if err != nil {
		return nil, err
	}
	explicitBase := base != 0
	if !explicitBase {
		base = o.healthBase.def
	}
	if base+3 > 65535 {
		return nil, fmt.Errorf("-health-port-base %d: base+3 must be a port", base)
	}
	stack := []service{{name: "worker"}, {name: "scheduler"}, {name: "gateway"}, {name: "api"}}
	for i := range stack {
		p, err := picker.pick(&o.healthBase, base+i, explicitBase)
		if err != nil {
			return nil, err
		}
		stack[i].health = fmt.Sprintf("127.0.0.1:%d", p)
	}
	for i, pf := range map[int]*portFlag{2: &o.gatewayPort, 3: &o.apiPort} {
		want, err := pf.explicit()
		if err != nil {
			return nil, err
		}
		explicit := want != 0
		if !explicit {
			want = pf.def
		}
		p, err := picker.pick(pf, want, explicit)
		if err != nil {
			return nil, err
		}
		stack[i].listen = fmt.Sprintf("127.0.0.1:%d", p)
	}
	return stack, nil
}

func runServices(ctx context.Context, logger *slog.Logger, o options, stack []service, nodes []devNode, url string) error {
	// Tunnels work out of the box: the gateway relays on a free loopback
	// port it publishes, the api dials it with the shared token.
	f, err := os.CreateTemp("", "leasehold-dev-relay-token-*")
	if err != nil {
		return fmt.Errorf("relay token file: %w", err)
	}
	relayFile := f.Name()
	defer func() { _ = os.Remove(relayFile) }()
	_, err = f.WriteString(relayToken + "\n")
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write the relay token file: %w", err)
	}
	env := append(os.Environ(), "LEASEHOLD_DATABASE_URL="+url, "LEASEHOLD_HEALTH_TOKEN="+devToken,
		"LEASEHOLD_API_TOKENS=admin:"+apiToken, "LEASEHOLD_GATEWAY_RELAY_LISTEN_ADDR=127.0.0.1:0",
		"LEASEHOLD_GATEWAY_RELAY_TOKEN_FILE="+relayFile, "LEASEHOLD_API_RELAY_TOKEN_FILE="+relayFile,
		// A dev gateway drains its nodes within seconds (production spreads
		// the reconnects of a large fleet over a minute), so Ctrl-C stops
		// the stack well inside each child's stop grace.
		"LEASEHOLD_GATEWAY_DRAIN_MAX_DELAY=2s", "LEASEHOLD_GATEWAY_DRAIN_GRACE=1s")
	runCtx, stopAll := context.WithCancel(ctx)
	defer stopAll()
	var wg sync.WaitGroup
	failed := make(chan error, len(stack))
	for _, s := range stack {
		args := []string{"--http-addr", s.health, "--log-format", "text"}
		if s.listen != "" {
			args = append(args, "--listen-addr", s.listen)
		}
		c := &child{name: s.name, path: filepath.Join(o.bin, "leasehold-"+s.name), args: args, env: env, policy: o.restart, logger: logger}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := c.run(runCtx); err != nil {
				failed <- err
			}
		}()
	}
	// Stop every child (SIGTERM, in parallel) before returning.
	defer func() { stopAll(); wg.Wait() }()

	readyErr := make(chan error, 1)
	go func() { readyErr <- waitReady(runCtx, stack) }()
	select {
	case err := <-failed:
		return err
	case err := <-readyErr:
		if err != nil {
			if ctx.Err() != nil {
				return nil // Ctrl-C while starting
			}
			return err
		}
	}
	byName := map[string]service{}
	for _, s := range stack {
		byName[s.name] = s
	}
	if err := enrollNodes(runCtx, logger, o, byName["api"].listen, nodes); err != nil {
		return err
	}
	nodeCtx, stopNodes := context.WithCancel(runCtx)
	var nodeWG sync.WaitGroup
	children, err := nodeChildren(o, logger, byName["gateway"].listen, nodes)
	if err != nil {
		stopNodes()
		return err
	}
	for _, c := range children {
		nodeWG.Go(func() {
			if err := c.run(nodeCtx); err != nil {
				failed <- err
			}
		})
	}
	// Deferred after the services' stop, so it runs first: the nodes end
	// their sessions before the gateway drains.
	defer func() { stopNodes(); nodeWG.Wait() }()
	readyCtx, cancelReady := context.WithTimeout(runCtx, time.Minute)
	err = waitNodesReady(readyCtx, nodes)
	cancelReady()
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	writeCLIContext(logger, o, byName["api"].listen)
	printEndpoints(stack, nodes, url)

	var timeout <-chan time.Time
	if o.exitAfter > 0 {
		timeout = time.After(o.exitAfter)
	}
	select {
	case <-ctx.Done():
		logger.Info("stopping the services")
		return nil
	case <-timeout:
		return nil
	case err := <-failed:
		return err
	}
}

// tryExec is the quick start's command: uname -a on a dev node, created
// with CreateCommand and awaited with WaitCommand (output is base64, as
// protobuf JSON writes bytes).
const tryExec = `  API=http://API_ADDR/leasehold.control.v1.ControlService AUTH='Authorization: Bearer TOKEN'
  ID=$(curl -s -H "$AUTH" -H 'Content-Type: application/json' $API/CreateCommand \
    -d '{"nodeId":"NODE","kind":"exec","payload":"'$(printf '{"argv":["uname","-a"]}' | base64 -w0)'"}' \
    | sed 's/.*"id":"\([^"]*\)".*/\1/')
  curl -s -H "$AUTH" -H 'Content-Type: application/json' $API/WaitCommand -d '{"commandId":"'$ID'"}'

`

func printEndpoints(stack []service, nodes []devNode, url string) {
	byName := map[string]service{}
	fmt.Println()
	fmt.Println("leasehold is running. Endpoints:")
	for _, s := range stack {
		byName[s.name] = s
		fmt.Printf("  %-10s http://%s/readyz  /livez  /metrics  /healthz/detail (Authorization: Bearer %s)\n", s.name, s.health, devToken)
	}
	fmt.Printf("  database   %s\n", redact(url))
	fmt.Printf("  nodes      connect to the gateway at http://%s (h2c)\n", byName["gateway"].listen)
	fmt.Printf("  api        http://%s (ControlService: Connect, gRPC, gRPC-Web)\n", byName["api"].listen)
	fmt.Printf("\nTry the api (admin token %q):\n", apiToken)
	fmt.Printf("  curl -s -H 'Authorization: Bearer %s' -H 'Content-Type: application/json' -d '{}' \\\n"+
		"    http://%s/leasehold.control.v1.ControlService/ListWorkers\n", apiToken, byName["api"].listen)
	fmt.Printf("  bin/leasehold-doctor check --database-url '%s'\n", url)
	fmt.Printf("\nNodes (leasehold-node, label %s), state under %s:\n", devFleetLabel, filepath.Dir(nodes[0].stateDir))
	for _, n := range nodes {
		fmt.Printf("  %-10s http://%s/readyz  /healthz/detail\n", n.id, n.health)
	}
	fmt.Printf("\nRun a command on %s with the CLI (docs/cli.md; context dev):\n  bin/leasehold run %s -- uname -a\n  bin/leasehold run -l %s -- uptime\n", nodes[0].id, nodes[0].id, devFleetLabel)
	fmt.Printf("\nor with curl (docs/node.md):\n")
	fmt.Print(strings.NewReplacer("API_ADDR", byName["api"].listen, "TOKEN", apiToken, "NODE", nodes[0].id).Replace(tryExec))
	fmt.Println("A service that exits is restarted (see the log). Press Ctrl-C to stop.")
}

// waitReady waits until every service answers /readyz 200. It has no
// deadline of its own: a service that fails is restarted and the log says
// why; Ctrl-C ends the wait.
func waitReady(ctx context.Context, stack []service) error {
	client := &http.Client{Timeout: 2 * time.Second}
	for _, s := range stack {
		for {
			resp, err := client.Get("http://" + s.health + "/readyz")
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					break
				}
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
