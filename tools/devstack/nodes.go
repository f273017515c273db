package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
)

// devNodes are the nodes `make run` enrolls and runs. Both carry the label
// devFleetLabel, so a selector names them together.
var devNodes = []string{"dev-node-1", "dev-node-2"}

// devFleetLabel is the label every dev node carries (assigned by the join
// token).
const devFleetLabel = "fleet=dev"

// devNode is one leasehold-node child of the stack.
type devNode struct {
	id       string
	stateDir string // absolute
	health   string // host:port of its /readyz
}

// planNodes gives every dev node its state directory and health port.
func planNodes(o options, picker *portPicker, base int) ([]devNode, error) {
	dir, err := filepath.Abs(filepath.Join(o.dir, "nodes"))
	if err != nil {
		return nil, err
	}
	nodes := make([]devNode, len(devNodes))
	for i, id := range devNodes {
		p, err := picker.pick(&portFlag{what: "the health endpoint of " + id, flag: "health-port-base", env: "LEASEHOLD_DEV_HEALTH_PORT_BASE"}, base+5+i, false)
		if err != nil {
			return nil, err
		}
		nodes[i] = devNode{id: id, stateDir: filepath.Join(dir, id), health: fmt.Sprintf("127.0.0.1:%d", p)}
	}
	return nodes, nil
}

// enrollNodes joins every dev node that has not joined yet, the way an
// operator joins a machine: a join token from the api (CreateJoinToken),
// then `leasehold-node join` with it. A node whose state directory holds
// a credential has joined before and is left alone.
func enrollNodes(ctx context.Context, logger *slog.Logger, o options, apiAddr string, nodes []devNode) error {
	var todo []devNode
	for _, n := range nodes {
		if _, err := os.Stat(filepath.Join(n.stateDir, "credential")); err != nil {
			todo = append(todo, n)
		}
	}
	if len(todo) == 0 {
		return nil
	}
	api := controlv1connect.NewControlServiceClient(http.DefaultClient, "http://"+apiAddr)
	k, v, _ := strings.Cut(devFleetLabel, "=")
	req := connect.NewRequest(&controlv1.CreateJoinTokenRequest{
		Ttl: durationpb.New(10 * time.Minute), MaxUses: int32(len(todo)),
		Labels: map[string]string{k: v}, Description: "make run: the dev nodes",
	})
	req.Header().Set("Authorization", "Bearer "+apiToken)
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	resp, err := api.CreateJoinToken(cctx, req)
	if err != nil {
		return fmt.Errorf("create a join token for the dev nodes: %w", err)
	}
	for _, n := range todo {
		cmd := exec.CommandContext(cctx, filepath.Join(o.bin, "leasehold-node"), "join",
			"--api-url", "http://"+apiAddr, "--state-dir", n.stateDir, "--node-id", n.id)
		cmd.Env = append(os.Environ(), "LEASEHOLD_JOIN_TOKEN="+resp.Msg.GetToken())
		out, err := cmd.CombinedOutput()
		if err != nil {
			return fmt.Errorf("leasehold-node join %s: %w: %s", n.id, err, strings.TrimSpace(string(out)))
		}
		logger.Info("dev node joined", "node", n.id, "out", strings.TrimSpace(string(out)))
	}
	return nil
}

// nodeChildren are the supervised leasehold-node processes of the nodes.
func nodeChildren(o options, logger *slog.Logger, gatewayAddr string, nodes []devNode) ([]*child, error) {
	var out []*child
	for _, n := range nodes {
		files := filepath.Join(n.stateDir, "files")
		if err := os.MkdirAll(files, 0o700); err != nil {
			return nil, fmt.Errorf("dev node %s: %w", n.id, err)
		}
		args := []string{
			"--gateway-url", "http://" + gatewayAddr, "--state-dir", n.stateDir, "--node-id", n.id,
			"--http-addr", n.health, "--log-format", "text",
			"--label", "dev=true", "--tunnel.shell", "/bin/sh", "--file.roots", files,
			// A dev stack restarts its services in a second, not a minute.
			"--redial-backoff-max", "2s",
			// Never --allow-reboot: docs/api.md's examples, which the
			// devstack test runs, send this machine's dev node a reboot.
		}
		out = append(out, &child{name: n.id, path: filepath.Join(o.bin, "leasehold-node"), args: args,
			env: os.Environ(), policy: o.restart, logger: logger})
	}
	return out, nil
}

// writeCLIContext writes (and keeps current) the context "dev" of the
// leasehold CLI in the user's config file, with the dev admin token in a
// 0600 file under the stack's directory, so `bin/leasehold run dev-node-1
// -- uname -a` works with no other step. The CLI changes no other context
// and makes dev current only when none is. A failure is reported, not
// fatal: the stack runs without it.
func writeCLIContext(logger *slog.Logger, o options, apiAddr string) {
	dir, err := filepath.Abs(o.dir)
	if err == nil {
		err = os.MkdirAll(dir, 0o700)
	}
	tokenFile := filepath.Join(dir, "admin-token")
	if err == nil {
		err = os.WriteFile(tokenFile, []byte(apiToken+"\n"), 0o600)
	}
	if err == nil {
		var out []byte
		out, err = exec.Command(filepath.Join(o.bin, "leasehold"), "context", "set", "dev",
			"--api", "http://"+apiAddr, "--token-file", tokenFile).CombinedOutput()
		if err != nil {
			err = fmt.Errorf("%w: %s", err, strings.TrimSpace(string(out)))
		}
	}
	if err != nil {
		logger.Warn("could not write the leasehold CLI's dev context; use curl or `leasehold context set`", "err", err)
		return
	}
	logger.Info("leasehold CLI context dev written", "api", "http://"+apiAddr, "token_file", tokenFile)
}

// waitNodesReady waits until every node's /readyz answers 200 (its session
// is up), or ctx ends.
func waitNodesReady(ctx context.Context, nodes []devNode) error {
	var s []service
	for _, n := range nodes {
		s = append(s, service{name: n.id, health: n.health})
	}
	err := waitReady(ctx, s)
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("the dev nodes did not connect in time (see their log lines above)")
	}
	return err
}
