package agent

import (
	"context"
	"encoding/json"
	"flag"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/fleettest"
	"github.com/leasehold/leasehold/pkg/nodereg"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

// heldBMC is a Redfish BMC whose first ComputerSystem.Reset is received
// and then held, unanswered, until the client goes away: the power action
// has reached the BMC, its answer never reaches the agent. Later resets
// are answered at once.
type heldBMC struct {
	*httptest.Server
	held chan struct{} // closed when the first reset arrives

	mu     sync.Mutex
	resets []string
}

func newHeldBMC(t *testing.T) *heldBMC {
	b := &heldBMC{held: make(chan struct{})}
	release := make(chan struct{})
	b.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == http.MethodPost && r.URL.Path == "/redfish/v1/SessionService/Sessions":
			w.Header().Set("X-Auth-Token", "tok")
			w.Header().Set("Location", "/redfish/v1/SessionService/Sessions/1")
			w.WriteHeader(http.StatusCreated)
		case r.Header.Get("X-Auth-Token") != "tok":
			w.WriteHeader(http.StatusUnauthorized)
		case r.Method == http.MethodGet && r.URL.Path == "/redfish/v1/Systems/1":
			_, _ = w.Write([]byte(`{"Actions":{"#ComputerSystem.Reset":{"target":"/redfish/v1/Systems/1/Actions/ComputerSystem.Reset","ResetType@Redfish.AllowableValues":["On","ForceOff","ForceRestart"]}}}`))
		case r.Method == http.MethodPost && r.URL.Path == "/redfish/v1/Systems/1/Actions/ComputerSystem.Reset":
			var body map[string]string
			_ = json.NewDecoder(r.Body).Decode(&body)
			b.mu.Lock()
			b.resets = append(b.resets, body["ResetType"])
			first := len(b.resets) == 1
			b.mu.Unlock()
			if first {
				close(b.held)
				select {
				case <-r.Context().Done(): // the agent was killed or stopped
				case <-release:
				}
				return
			}
			w.WriteHeader(http.StatusNoContent)
		case r.Method == http.MethodDelete:
			w.WriteHeader(http.StatusNoContent)
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(func() { close(release); b.Close() })
	return b
}

func (b *heldBMC) Resets() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.resets...)
}

// awaitHeld waits for the first reset to reach the BMC.
func (b *heldBMC) awaitHeld(t *testing.T) {
	t.Helper()
	select {
	case <-b.held:
	case <-time.After(30 * time.Second):
		t.Fatal("the BMC command never reached the BMC")
	}
}

// bmcCommand inserts a power.cycle of the BMC for nodeID and returns its id.
func bmcCommand(t *testing.T, db *pgtest.DB, nodeID, endpoint string) string {
	t.Helper()
	payload, err := json.Marshal(map[string]string{"endpoint": endpoint, "system_id": "1", "credentials": "rack1"})
	require.NoError(t, err)
	var id string
	require.NoError(t, db.Pool.QueryRow(context.Background(),
		`INSERT INTO commands (node_id, kind, payload) VALUES ($1, 'power.cycle', $2) RETURNING id`, nodeID, payload).Scan(&id))
	return id
}

// commandResult waits for the command to end and returns its state and its
// stored result.
func commandResult(t *testing.T, db *pgtest.DB, id string) (state, resultID, errText string, exitCode int32) {
	t.Helper()
	ctx := context.Background()
	require.Eventually(t, func() bool {
		_ = db.Pool.QueryRow(ctx, `SELECT state FROM commands WHERE id = $1`, id).Scan(&state)
		return state == "succeeded" || state == "failed"
	}, 60*time.Second, 50*time.Millisecond, "the command never ended")
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT id, error, exit_code FROM command_results_all WHERE command_id = $1`, id).
		Scan(&resultID, &errText, &exitCode))
	return state, resultID, errText, exitCode
}

func bmcCredentialsFile(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "bmc.json")
	require.NoError(t, os.WriteFile(p, []byte(`{"rack1":{"username":"u","password":"p"}}`), 0o600))
	return p
}

// TestBMCCommandRunsOnceAcrossAKill: a site agent process is killed
// (SIGKILL) while a power.cycle it started is held at the BMC, after the
// BMC received the reset and before its answer. A new agent process on the
// same --journal gets the same command id replayed by the gateway and does
// not run it again: the journal has it started and never finished, so it is
// reported interrupted (pkg/daemon's contract), and the BMC has seen one
// reset.
func TestBMCCommandRunsOnceAcrossAKill(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	db := pgtest.NewDB(t)
	ctx := context.Background()
	gw := fleettest.StartGateway(t, db.URL, "gw_journal_kill", siteGatewayArgs...)
	cred, err := nodereg.Register(ctx, db.Pool, nodereg.Node{ID: "agent-k", Kind: "site_agent", SiteID: "site1"})
	require.NoError(t, err)
	bmc := newHeldBMC(t)
	bin := fleettest.Binary(t, "site-agent")
	dir := t.TempDir()
	journal := filepath.Join(dir, "state", "journal")
	creds := bmcCredentialsFile(t)
	start := func(name string) *proctest.Proc {
		p := proctest.Start(t, name, bin, []string{"LEASEHOLD_NODE_CREDENTIAL=" + cred},
			"--gateway-url", gw.URL(), "--node-id", "agent-k", "--site-id", "site1", "--redial-backoff-max", "1s",
			"--journal", journal, "--bmc.credentials-file", creds,
			"--dhcp.listen-addr", "127.0.0.1:0", "--dhcp.pxe-listen-addr", "", "--dhcp.server-ip", "127.0.0.1",
			"--tftp.listen-addr", "127.0.0.1:0", "--tftp.root", t.TempDir(), "--boot.listen-addr", "127.0.0.1:0",
			"--cache.dir", t.TempDir(), "--http-addr", fleettest.Addr(t), "--log-format", "text", "--log-level", "debug")
		p.WaitReady(60 * time.Second)
		return p
	}

	first := start("site-agent-1")
	id := bmcCommand(t, db, "agent-k", bmc.URL)
	bmc.awaitHeld(t)
	first.Kill()
	killed := time.Now()

	start("site-agent-2")
	ready := time.Since(killed)
	state, resultID, errText, exitCode := commandResult(t, db, id)
	t.Logf("kill -> second agent ready %s, -> command ended %s", ready.Round(time.Millisecond), time.Since(killed).Round(time.Millisecond))
	require.Equal(t, []string{"ForceRestart"}, bmc.Resets(), "the BMC received the power action once")
	require.Equal(t, "failed", state)
	require.Equal(t, id+"/interrupted", resultID, "the restarted agent reports the command interrupted")
	require.EqualValues(t, -1, exitCode)
	require.Contains(t, errText, "it is not run again")
}

// TestBMCCommandRunsOnceAcrossAStop: the same across a graceful stop (what
// systemd's restart does), with the agent cut off from the gateway first
// so its result cannot reach the gateway before the stop. The stop cancels
// the held Redfish call and journals that result; a new agent on the same
// --journal gets the command replayed and re-sends the journalled result
// instead of resetting the machine again.
func TestBMCCommandRunsOnceAcrossAStop(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	db := pgtest.NewDB(t)
	ctx := context.Background()
	gw := fleettest.StartGateway(t, db.URL, "gw_journal_stop", siteGatewayArgs...)
	cred, err := nodereg.Register(ctx, db.Pool, nodereg.Node{ID: "agent-s", Kind: "site_agent", SiteID: "site1"})
	require.NoError(t, err)
	bmc := newHeldBMC(t)
	journal := filepath.Join(t.TempDir(), "journal")
	creds := bmcCredentialsFile(t)
	var logs syncBuf
	defer func() {
		if t.Failed() {
			t.Logf("--- agent logs ---\n%s", logs.String())
		}
	}()
	mutate := func(c *Config) { c.Journal, c.BMC.CredentialsFile = journal, creds }

	first := startAgent(t, "agent-s", "site1", cred, gw.Listen, &logs, mutate)
	require.Eventually(t, func() bool { return first.d.Welcome() != nil }, 20*time.Second, 20*time.Millisecond)
	id := bmcCommand(t, db, "agent-s", bmc.URL)
	bmc.awaitHeld(t)
	first.proxy.Refuse()
	first.proxy.CutAll()
	sctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	require.NoError(t, services.StopAndAwaitTerminated(sctx, first))

	startAgent(t, "agent-s", "site1", cred, gw.Listen, &logs, mutate)
	state, resultID, errText, _ := commandResult(t, db, id)
	require.Equal(t, []string{"ForceRestart"}, bmc.Resets(), "the BMC received the power action once")
	require.Equal(t, "failed", state)
	require.Equal(t, id+"/1", resultID, "the result of the one run, from the journal")
	require.Contains(t, errText, "context canceled")
}

// TestJournalErrorsNameTheFlag: a journal that cannot be opened, or that
// another agent holds, is refused naming --journal.
func TestJournalErrorsNameTheFlag(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "journal")
	j, err := openJournal(path)
	require.NoError(t, err)
	_, err = openJournal(path)
	require.ErrorContains(t, err, "--journal "+path+": another process holds "+path+".lock")
	require.NoError(t, j.Close())
	j, err = openJournal(path) // the lock went with the close
	require.NoError(t, err)
	require.NoError(t, j.Close())

	file := filepath.Join(dir, "a-file")
	require.NoError(t, os.WriteFile(file, nil, 0o600))
	_, err = openJournal(filepath.Join(file, "journal"))
	require.ErrorContains(t, err, "--journal "+filepath.Join(file, "journal")+": create its directory")

	open := filepath.Join(dir, "open")
	require.NoError(t, os.Mkdir(open, 0o700))
	require.NoError(t, os.Chmod(open, 0o777)) // past the umask
	_, err = openJournal(filepath.Join(open, "journal"))
	require.ErrorContains(t, err, "group or others may write to it")

	var c Config
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	c.RegisterFlags("", fs)
	require.Equal(t, DefaultJournal, c.Journal)
	require.NoError(t, fs.Parse([]string{"--node-id", "a1", "--node-credential", "x", "--site-id", "s1",
		"--dhcp.server-ip", "10.0.0.2", "--journal", "relative/journal"}))
	require.ErrorContains(t, c.Resolve(), `--journal "relative/journal" must be an absolute path`)
}
