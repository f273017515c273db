package agent

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/fleettest"
	"github.com/leasehold/leasehold/pkg/nodereg"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestStandbyServesTheCacheAndRunsBMCCommands: the agent that does not
// hold the boot lease still serves images (fetching a missing one from the
// origin) and runs a BMC command sent through the control plane, while it
// answers no boot request.
func TestStandbyServesTheCacheAndRunsBMCCommands(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	db := pgtest.NewDB(t)
	ctx := context.Background()
	gw := fleettest.StartGateway(t, db.URL, "gw_stb", siteGatewayArgs...)
	fleettest.StartService(t, "worker", db.URL, "w_stb", append(append([]string{}, fleettest.FastCoord...), siteWorkerArgs...)...)

	image := []byte("an initrd the standby has never seen")
	sum := sha256.Sum256(image)
	digest := hex.EncodeToString(sum[:])
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/"+digest {
			http.NotFound(w, r)
			return
		}
		_, _ = w.Write(image)
	}))
	defer origin.Close()

	var (
		mu     sync.Mutex
		resets []string
	)
	bmc := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == http.MethodPost && r.URL.Path == "/redfish/v1/SessionService/Sessions":
			w.Header().Set("X-Auth-Token", "tok")
			w.WriteHeader(http.StatusCreated)
		case r.Header.Get("X-Auth-Token") != "tok":
			w.WriteHeader(http.StatusUnauthorized)
		case r.Method == http.MethodGet && r.URL.Path == "/redfish/v1/Systems/1":
			_, _ = w.Write([]byte(`{"Actions":{"#ComputerSystem.Reset":{"target":"/redfish/v1/Systems/1/Actions/ComputerSystem.Reset","ResetType@Redfish.AllowableValues":["On","ForceOff","ForceRestart"]}}}`))
		case r.Method == http.MethodPost && r.URL.Path == "/redfish/v1/Systems/1/Actions/ComputerSystem.Reset":
			var body map[string]string
			_ = json.NewDecoder(r.Body).Decode(&body)
			mu.Lock()
			resets = append(resets, body["ResetType"])
			mu.Unlock()
			w.WriteHeader(http.StatusNoContent)
		default:
			http.NotFound(w, r)
		}
	}))
	defer bmc.Close()
	credFile := filepath.Join(t.TempDir(), "bmc.json")
	require.NoError(t, os.WriteFile(credFile, []byte(`{"rack1":{"username":"u","password":"p"}}`), 0o600))

	var logs syncBuf
	defer func() {
		if t.Failed() {
			t.Logf("--- agent logs ---\n%s", logs.String())
		}
	}()
	var agents [2]*testAgent
	for i, id := range []string{"agent-a", "agent-b"} {
		cred, err := nodereg.Register(ctx, db.Pool, nodereg.Node{ID: id, Kind: "site_agent", SiteID: "site1"})
		require.NoError(t, err)
		agents[i] = startAgent(t, id, "site1", cred, gw.Listen, &logs, func(c *Config) {
			c.Cache.Origin = origin.URL
			c.BMC.CredentialsFile = credFile
		})
	}
	require.Eventually(t, func() bool {
		_, a := agents[0].Answering()
		_, b := agents[1].Answering()
		return a != b
	}, 20*time.Second, 20*time.Millisecond, "one agent becomes active")
	stb := agents[0]
	if _, ok := stb.Answering(); ok {
		stb = agents[1]
	}

	resp, err := http.Get("http://" + stb.BootAddr() + "/images/sha256/" + digest)
	require.NoError(t, err)
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, image, got, "the standby fetched the image from the origin and served it")
	resp, err = http.Get("http://" + stb.BootAddr() + "/boot/52-54-00-aa-bb-cc.ipxe")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, "but no boot script")

	payload, _ := json.Marshal(map[string]string{"endpoint": bmc.URL, "system_id": "1", "credentials": "rack1"})
	var cmdID string
	require.NoError(t, db.Pool.QueryRow(ctx, `INSERT INTO commands (node_id, kind, payload) VALUES ($1, 'power.cycle', $2) RETURNING id`,
		stb.id, payload).Scan(&cmdID))
	require.Eventually(t, func() bool {
		var state string
		_ = db.Pool.QueryRow(ctx, `SELECT state FROM commands WHERE id = $1`, cmdID).Scan(&state)
		return state == "succeeded"
	}, 20*time.Second, 50*time.Millisecond, "the standby ran the BMC command")
	mu.Lock()
	require.Equal(t, []string{"ForceRestart"}, resets)
	mu.Unlock()
	_, ok := stb.Answering()
	require.False(t, ok, "still a standby")
}
