package redfish

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

const (
	user   = "bmc-admin-user"
	secret = "s3cr3t-p@ssw0rd-never-logged"
)

type call struct {
	Method, Path string
	Body         map[string]any
}

// bmc is an in-test Redfish server with one system, "1".
type bmc struct {
	mu    sync.Mutex
	calls []call
}

func (b *bmc) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u, p, ok := r.BasicAuth()
	if !ok || u != user || p != secret {
		w.WriteHeader(http.StatusUnauthorized)
		_, _ = w.Write([]byte(`{"error":{"message":"bad credentials"}}`))
		return
	}
	var body map[string]any
	_ = json.NewDecoder(r.Body).Decode(&body)
	b.mu.Lock()
	b.calls = append(b.calls, call{r.Method, r.URL.Path, body})
	b.mu.Unlock()
	switch {
	case r.Method == http.MethodPost && r.URL.Path == "/redfish/v1/Systems/1/Actions/ComputerSystem.Reset":
		w.WriteHeader(http.StatusNoContent)
	case r.Method == http.MethodPatch && r.URL.Path == "/redfish/v1/Systems/1":
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte(`{}`))
	default:
		w.WriteHeader(http.StatusNotFound)
	}
}

func setup(t *testing.T) (*Client, *bmc, *httptest.Server, *bytes.Buffer) {
	t.Helper()
	b := &bmc{}
	srv := httptest.NewTLSServer(b)
	t.Cleanup(srv.Close)
	dir := t.TempDir()
	credFile := filepath.Join(dir, "bmc.json")
	require.NoError(t, os.WriteFile(credFile, []byte(fmt.Sprintf(`{"rack1":{"username":%q,"password":%q},"wrong":{"username":"x","password":%q}}`, user, secret, secret+"-old")), 0o600))
	var logs bytes.Buffer
	log := slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	c, err := New(Config{CredentialsFile: credFile, InsecureSkipVerify: true}, log)
	require.NoError(t, err)
	return c, b, srv, &logs
}

func payload(endpoint, system, ref string) []byte {
	b, _ := json.Marshal(map[string]string{"endpoint": endpoint, "system_id": system, "credentials": ref})
	return b
}

func TestPowerAndBootCommandsAgainstARedfishServer(t *testing.T) {
	t.Parallel()
	c, b, srv, logs := setup(t)
	ctx := context.Background()
	for _, kind := range []string{KindPowerOn, KindPowerOff, KindPowerCycle, KindPXEOnce} {
		out, err := c.Run(ctx, kind, payload(srv.URL, "1", "rack1"))
		require.NoError(t, err, kind)
		require.NotContains(t, string(out), secret)
	}
	require.Equal(t, []call{
		{"POST", "/redfish/v1/Systems/1/Actions/ComputerSystem.Reset", map[string]any{"ResetType": "On"}},
		{"POST", "/redfish/v1/Systems/1/Actions/ComputerSystem.Reset", map[string]any{"ResetType": "ForceOff"}},
		{"POST", "/redfish/v1/Systems/1/Actions/ComputerSystem.Reset", map[string]any{"ResetType": "ForceRestart"}},
		{"PATCH", "/redfish/v1/Systems/1", map[string]any{"Boot": map[string]any{"BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Once"}}},
	}, b.calls)

	// Failures: wrong credentials, unknown system, unknown reference,
	// secrets smuggled into the payload, an unreachable BMC.
	_, err := c.Run(ctx, KindPowerOn, payload(srv.URL, "1", "wrong"))
	require.ErrorContains(t, err, "401")
	_, err = c.Run(ctx, KindPowerOn, payload(srv.URL, "2", "rack1"))
	require.ErrorContains(t, err, "404")
	_, err = c.Run(ctx, KindPowerOn, payload(srv.URL, "1", "nope"))
	require.ErrorContains(t, err, `credentials reference "nope" is not configured`)
	_, err = c.Run(ctx, KindPowerOn, []byte(`{"endpoint":"https://`+user+`:`+secret+`@bmc","credentials":"rack1"}`))
	require.ErrorContains(t, err, "must not carry credentials")
	_, err = c.Run(ctx, KindPowerOn, []byte(`{"endpoint":"https://bmc","credentials":"rack1","password":"`+secret+`"}`))
	require.Error(t, err)
	_, err = c.Run(ctx, KindPowerOn, payload("https://127.0.0.1:1", "1", "rack1"))
	require.Error(t, err)
	_, err = c.Run(ctx, "power.explode", payload(srv.URL, "1", "rack1"))
	require.ErrorContains(t, err, "unknown BMC command kind")

	// The credentials print redacted everywhere.
	cred := Credentials{Username: user, Password: secret}
	slog.New(slog.NewJSONHandler(logs, nil)).Info("a careless line", "cred", cred)
	require.NotContains(t, fmt.Sprintf("%v %+v %#v %s", cred, cred, cred, cred), secret)

	out := logs.String()
	require.Contains(t, out, `"credentials_ref":"rack1"`, "calls are logged by reference")
	require.NotContains(t, out, secret, "no password in the logs")
	require.NotContains(t, out, secret+"-old")
	require.NotContains(t, out, user, "no BMC username in the logs either")
	_, _ = io.Copy(io.Discard, logs)
}
