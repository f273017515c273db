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
	"slices"
	"strings"
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

// bmc is a strict in-test Redfish service with one system, "1", behaving
// like the BMCs docs/site-agent.md names: sessions (X-Auth-Token) only, no
// Basic; If-Match with the current ETag on PATCH (428 without, 412 when
// stale); reset types and boot targets advertised as AllowableValues; a
// Redfish error body on every refusal.
type bmc struct {
	mu       sync.Mutex
	calls    []call
	tokens   map[string]bool
	logins   int
	basic    int // calls that tried Basic authentication
	etagN    int
	boot     map[string]any
	resets   []string
	noETag   bool // advertise no ETag at all
	bumpOnce bool // change the ETag right after the next GET (a concurrent writer)
}

func newBMC() *bmc { return &bmc{tokens: map[string]bool{}, etagN: 1, boot: map[string]any{}} }

func redfishErr(w http.ResponseWriter, code int, id, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{"code": "Base.1.8.GeneralError",
		"message":               "A general error has occurred. See ExtendedInfo for more information.",
		"@Message.ExtendedInfo": []map[string]any{{"MessageId": id, "Message": msg, "Resolution": "Correct the request and resubmit."}}}})
}

func (b *bmc) etag() string { return fmt.Sprintf(`W/"%d"`, b.etagN) }

func (b *bmc) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b.mu.Lock()
	defer b.mu.Unlock()
	var body map[string]any
	_ = json.NewDecoder(r.Body).Decode(&body)
	if _, _, ok := r.BasicAuth(); ok {
		b.basic++
	}
	if r.Method == http.MethodPost && r.URL.Path == "/redfish/v1/SessionService/Sessions" {
		if body["UserName"] != user || body["Password"] != secret {
			redfishErr(w, http.StatusUnauthorized, "Base.1.8.NoValidSession", "invalid user name or password")
			return
		}
		b.logins++
		tok := fmt.Sprintf("token-%d", b.logins)
		b.tokens[tok] = true
		w.Header().Set("X-Auth-Token", tok)
		w.Header().Set("Location", fmt.Sprintf("/redfish/v1/SessionService/Sessions/%d", b.logins))
		w.WriteHeader(http.StatusCreated)
		return
	}
	if !b.tokens[r.Header.Get("X-Auth-Token")] {
		redfishErr(w, http.StatusUnauthorized, "Base.1.8.NoValidSession", "there is no valid session established with the implementation")
		return
	}
	if r.Method == http.MethodDelete && strings.HasPrefix(r.URL.Path, "/redfish/v1/SessionService/Sessions/") {
		delete(b.tokens, r.Header.Get("X-Auth-Token"))
		w.WriteHeader(http.StatusNoContent)
		return
	}
	b.calls = append(b.calls, call{r.Method, r.URL.Path, body})
	const sys = "/redfish/v1/Systems/1"
	switch {
	case r.Method == http.MethodGet && r.URL.Path == sys:
		doc := map[string]any{"@odata.id": sys, "Id": "1",
			"Boot": map[string]any{"BootSourceOverrideTarget@Redfish.AllowableValues": []string{"None", "Pxe", "UefiHttp", "Hdd"}},
			"Actions": map[string]any{"#ComputerSystem.Reset": map[string]any{"target": sys + "/Actions/ComputerSystem.Reset",
				"ResetType@Redfish.AllowableValues": []string{"On", "ForceOff", "GracefulShutdown", "GracefulRestart", "ForceRestart"}}}}
		if !b.noETag {
			doc["@odata.etag"] = b.etag()
			w.Header().Set("ETag", b.etag())
		}
		if b.bumpOnce {
			b.bumpOnce = false
			b.etagN++
		}
		_ = json.NewEncoder(w).Encode(doc)
	case r.Method == http.MethodPatch && r.URL.Path == sys:
		im := r.Header.Get("If-Match")
		switch {
		case im == "":
			redfishErr(w, http.StatusPreconditionRequired, "Base.1.8.PreconditionRequired", "a precondition header is required for this request")
		case im != b.etag():
			redfishErr(w, http.StatusPreconditionFailed, "Base.1.8.PreconditionFailed", "the ETag supplied did not match the ETag of the resource")
		default:
			b.boot = body["Boot"].(map[string]any)
			b.etagN++
			w.WriteHeader(http.StatusNoContent)
		}
	case r.Method == http.MethodPost && r.URL.Path == sys+"/Actions/ComputerSystem.Reset":
		rt, _ := body["ResetType"].(string)
		if !slices.Contains([]string{"On", "ForceOff", "GracefulShutdown", "GracefulRestart", "ForceRestart"}, rt) {
			redfishErr(w, http.StatusBadRequest, "Base.1.8.ActionParameterValueNotInList", fmt.Sprintf("the value %q for ResetType is not in the list of acceptable values", rt))
			return
		}
		b.resets = append(b.resets, rt)
		w.WriteHeader(http.StatusNoContent)
	default:
		redfishErr(w, http.StatusNotFound, "Base.1.8.ResourceMissingAtURI", "the resource at the URI "+r.URL.Path+" was not found")
	}
}

func setup(t *testing.T) (*Client, *bmc, *httptest.Server, *bytes.Buffer) {
	t.Helper()
	b := newBMC()
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

func TestPowerAndBootCommandsAgainstAStrictBMC(t *testing.T) {
	t.Parallel()
	c, b, srv, logs := setup(t)
	ctx := context.Background()
	for _, kind := range []string{KindPowerOn, KindPowerOff, KindPowerCycle, KindPXEOnce, KindHTTPOnce} {
		out, err := c.Run(ctx, kind, payload(srv.URL, "1", "rack1"))
		require.NoError(t, err, kind)
		require.NotContains(t, string(out), secret)
	}
	out, err := c.Run(ctx, KindPowerReset, []byte(`{"endpoint":"`+srv.URL+`","system_id":"1","credentials":"rack1","reset_type":"GracefulShutdown"}`))
	require.NoError(t, err)
	require.Contains(t, string(out), "204")
	b.mu.Lock()
	require.Equal(t, []string{"On", "ForceOff", "ForceRestart", "GracefulShutdown"}, b.resets)
	require.Equal(t, map[string]any{"BootSourceOverrideTarget": "UefiHttp", "BootSourceOverrideEnabled": "Once", "BootSourceOverrideMode": "UEFI"}, b.boot)
	require.Equal(t, 1, b.logins, "one session for every call")
	require.Zero(t, b.basic, "never Basic authentication")
	var patches []call
	for _, cl := range b.calls {
		if cl.Method == http.MethodPatch {
			patches = append(patches, cl)
		}
	}
	require.Equal(t, []call{
		{"PATCH", "/redfish/v1/Systems/1", map[string]any{"Boot": map[string]any{"BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Once"}}},
		{"PATCH", "/redfish/v1/Systems/1", map[string]any{"Boot": map[string]any{"BootSourceOverrideTarget": "UefiHttp", "BootSourceOverrideEnabled": "Once", "BootSourceOverrideMode": "UEFI"}}},
	}, patches)
	b.mu.Unlock()

	// The session expires on the BMC: the next call opens another, once.
	b.mu.Lock()
	clear(b.tokens)
	b.mu.Unlock()
	_, err = c.Run(ctx, KindPowerOn, payload(srv.URL, "1", "rack1"))
	require.NoError(t, err)
	b.mu.Lock()
	require.Equal(t, 2, b.logins)
	b.mu.Unlock()

	// A concurrent writer changes the ETag between read and write: 412,
	// re-read, retried once.
	b.mu.Lock()
	b.bumpOnce = true
	b.mu.Unlock()
	_, err = c.Run(ctx, KindPXEOnce, payload(srv.URL, "1", "rack1"))
	require.NoError(t, err)

	// Types the BMC does not advertise are refused before anything is sent.
	_, err = c.Run(ctx, KindPowerReset, []byte(`{"endpoint":"`+srv.URL+`","system_id":"1","credentials":"rack1","reset_type":"PowerCycle"}`))
	require.ErrorContains(t, err, "the BMC does not offer reset type PowerCycle (it offers On, ForceOff, GracefulShutdown, GracefulRestart, ForceRestart)")
	_, err = c.Run(ctx, KindPowerReset, payload(srv.URL, "1", "rack1"))
	require.ErrorContains(t, err, "payload.reset_type is required by power.reset")

	// Without an ETag the strict BMC answers 428, with its Redfish error
	// made readable.
	b.mu.Lock()
	b.noETag = true
	b.mu.Unlock()
	_, err = c.Run(ctx, KindPXEOnce, payload(srv.URL, "1", "rack1"))
	require.ErrorContains(t, err, "428")
	require.ErrorContains(t, err, "the BMC requires If-Match and no ETag was available")
	require.ErrorContains(t, err, "Base.1.8.PreconditionRequired: a precondition header is required for this request")

	// Failures: wrong credentials, unknown system, unknown reference,
	// secrets smuggled into the payload, an unreachable BMC.
	_, err = c.Run(ctx, KindPowerOn, payload(srv.URL, "1", "wrong"))
	require.ErrorContains(t, err, "401")
	require.ErrorContains(t, err, "invalid user name or password")
	_, err = c.Run(ctx, KindPowerOn, payload(srv.URL, "2", "rack1"))
	require.ErrorContains(t, err, "404")
	require.ErrorContains(t, err, "Base.1.8.ResourceMissingAtURI")
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

	c.Close(ctx)
	b.mu.Lock()
	require.Empty(t, b.tokens, "sessions are deleted on close")
	b.mu.Unlock()

	// The credentials print redacted everywhere.
	cred := Credentials{Username: user, Password: secret}
	slog.New(slog.NewJSONHandler(logs, nil)).Info("a careless line", "cred", cred)
	require.NotContains(t, fmt.Sprintf("%v %+v %#v %s", cred, cred, cred, cred), secret)

	out2 := logs.String()
	require.Contains(t, out2, `"credentials_ref":"rack1"`, "calls are logged by reference")
	require.Contains(t, out2, "redfish call refused by the BMC")
	require.NotContains(t, out2, secret, "no password in the logs")
	require.NotContains(t, out2, secret+"-old")
	require.NotContains(t, out2, user, "no BMC username in the logs either")
	require.NotContains(t, out2, "token-", "no session token in the logs")
	_, _ = io.Copy(io.Discard, logs)
}

// A BMC without a session service gets Basic authentication.
func TestFallsBackToBasicWithoutASessionService(t *testing.T) {
	t.Parallel()
	var basic int
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/redfish/v1/SessionService/Sessions" {
			http.NotFound(w, r)
			return
		}
		if u, p, ok := r.BasicAuth(); !ok || u != user || p != secret {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		basic++
		if r.Method == http.MethodGet {
			_, _ = w.Write([]byte(`{"Id":"1"}`))
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	defer srv.Close()
	c, err := New(Config{InsecureSkipVerify: true}, nil)
	require.NoError(t, err)
	c.SetCredentials(map[string]Credentials{"r": {Username: user, Password: secret}})
	_, err = c.Run(context.Background(), KindPowerCycle, payload(srv.URL, "1", "r"))
	require.NoError(t, err)
	require.Equal(t, 2, basic, "GET of the system, then the reset")
}

func TestRedfishErrorBodies(t *testing.T) {
	t.Parallel()
	require.Equal(t, "Base.1.0.GeneralError; oops; Base.1.0.PropertyUnknown: The property Foo is not known (resolution: Remove it)",
		redfishError([]byte(`{"error":{"code":"Base.1.0.GeneralError","message":"oops","@Message.ExtendedInfo":[{"MessageId":"Base.1.0.PropertyUnknown","Message":"The property Foo is not known","Resolution":"Remove it"}]}}`)))
	for _, b := range []string{``, `not json`, `{}`, `{"error":{}}`, `[1,2]`, `{"error":"x"}`} {
		require.Empty(t, redfishError([]byte(b)), b)
	}
	long := `{"error":{"message":"` + strings.Repeat("x", 5000) + `"}}`
	require.LessOrEqual(t, len(redfishError([]byte(long))), 520)
}
