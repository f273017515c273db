// Package redfish drives BMC power and boot through Redfish, for node
// commands addressed to a site agent:
//
//	power.on        POST <Reset target> {"ResetType": first advertised of On, ForceOn}
//	power.off       POST <Reset target> {"ResetType": "ForceOff"}
//	power.cycle     POST <Reset target> {"ResetType": first advertised of ForceRestart, PowerCycle}
//	power.reset     POST <Reset target> {"ResetType": payload.reset_type}, which the BMC must advertise
//	boot.pxe-once   PATCH {system} {"Boot":{"BootSourceOverrideTarget":"Pxe","BootSourceOverrideEnabled":"Once"}}
//	boot.http-once  PATCH {system} {"Boot":{"BootSourceOverrideTarget":"UefiHttp","BootSourceOverrideEnabled":"Once","BootSourceOverrideMode":"UEFI"}}
//
// where {system} is /redfish/v1/Systems/{id} and <Reset target> is the
// ComputerSystem.Reset action's target as the system resource names it. A
// command's payload names the BMC and a credentials reference, never a
// secret:
//
//	{"endpoint":"https://10.0.0.5","system_id":"1","credentials":"rack1-bmc"}
//
// Behaviour for real BMCs (docs/site-agent.md, "BMC commands"):
//   - a Redfish session (POST SessionService/Sessions, then X-Auth-Token) is
//     opened once per BMC and account and reused; a 401 opens a new one and
//     retries once; Basic authentication is used only when the BMC has no
//     session service (404/405/501 on the sessions collection);
//   - every PATCH carries If-Match with the resource's current ETag (from
//     the ETag header, else @odata.etag); a 412 re-reads and retries once;
//   - a reset type or boot target the system does not advertise
//     (…@Redfish.AllowableValues) is refused before anything is sent;
//   - a Redfish error body (error.code, message, @Message.ExtendedInfo) is
//     turned into one readable error.
//
// The reference is looked up in the agent's credentials file. Secrets are
// never logged, never put in an error or a command result, and the
// Credentials type redacts itself in any slog or fmt output.
package redfish

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"
)

// Command kinds handled here.
const (
	KindPowerOn    = "power.on"
	KindPowerOff   = "power.off"
	KindPowerCycle = "power.cycle"
	KindPowerReset = "power.reset"
	KindPXEOnce    = "boot.pxe-once"
	KindHTTPOnce   = "boot.http-once"
)

// Handles reports whether kind is a BMC command.
func Handles(kind string) bool {
	switch kind {
	case KindPowerOn, KindPowerOff, KindPowerCycle, KindPowerReset, KindPXEOnce, KindHTTPOnce:
		return true
	}
	return false
}

// resetPreference lists, per command, the reset types to use in order; the
// first the BMC advertises wins.
var resetPreference = map[string][]string{
	KindPowerOn:    {"On", "ForceOn"},
	KindPowerOff:   {"ForceOff"},
	KindPowerCycle: {"ForceRestart", "PowerCycle"},
}

// Credentials are a BMC account. They print as [redacted].
type Credentials struct {
	Username string `json:"username"`
	Password string `json:"password"`
}

// String redacts.
func (Credentials) String() string { return "[redacted]" }

// GoString redacts.
func (Credentials) GoString() string { return "[redacted]" }

// LogValue redacts.
func (Credentials) LogValue() slog.Value { return slog.StringValue("[redacted]") }

// Payload is a BMC command's payload.
type Payload struct {
	Endpoint    string `json:"endpoint"`
	SystemID    string `json:"system_id"`
	Credentials string `json:"credentials"`
	// ResetType is power.reset's Redfish reset type (for example
	// GracefulShutdown); the BMC must advertise it.
	ResetType string `json:"reset_type,omitempty"`
}

var (
	systemIDRE = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)
	credRefRE  = regexp.MustCompile(`^[A-Za-z0-9._:/-]{1,128}$`)
	resetRE    = regexp.MustCompile(`^[A-Za-z]{1,32}$`)
)

// Config configures the client.
type Config struct {
	// CredentialsFile is a JSON object {"<ref>": {"username":…, "password":…}}.
	CredentialsFile string
	// InsecureSkipVerify accepts BMC certificates without verification
	// (BMCs often present self-signed ones).
	InsecureSkipVerify bool
	// Timeout bounds one Redfish call (30 s).
	Timeout time.Duration
}

// Client runs BMC commands.
type Client struct {
	http *http.Client
	log  *slog.Logger

	mu       sync.RWMutex
	creds    map[string]Credentials
	sessions map[sessionKey]*session
}

// sessionKey is one BMC and one account.
type sessionKey struct{ endpoint, ref string }

// session is an open Redfish session, or basic when the BMC has none.
type session struct {
	token, location string
	basic           bool
}

// New returns a client; it loads cfg.CredentialsFile when set.
func New(cfg Config, log *slog.Logger) (*Client, error) {
	if cfg.Timeout <= 0 {
		cfg.Timeout = 30 * time.Second
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: cfg.InsecureSkipVerify} //nolint:gosec // operator's choice for self-signed BMCs
	c := &Client{http: &http.Client{Transport: tr, Timeout: cfg.Timeout,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }},
		log: log, creds: map[string]Credentials{}, sessions: map[sessionKey]*session{}}
	if cfg.CredentialsFile != "" {
		b, err := os.ReadFile(cfg.CredentialsFile)
		if err != nil {
			return nil, fmt.Errorf("read --bmc.credentials-file: %w", err)
		}
		var m map[string]Credentials
		if err := json.Unmarshal(b, &m); err != nil {
			// The decoder's error may quote the file: do not pass it on.
			return nil, fmt.Errorf("--bmc.credentials-file %s is not a JSON object of {username, password}", cfg.CredentialsFile)
		}
		c.SetCredentials(m)
	}
	return c, nil
}

// SetCredentials replaces the credentials table.
func (c *Client) SetCredentials(m map[string]Credentials) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.creds = make(map[string]Credentials, len(m))
	for k, v := range m {
		c.creds[k] = v
	}
}

// ParsePayload decodes and validates a command payload.
func ParsePayload(b []byte) (Payload, error) {
	var p Payload
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&p); err != nil {
		return Payload{}, errors.New(`payload must be {"endpoint":"https://bmc","system_id":"1","credentials":"<ref>"} (no secrets)`)
	}
	u, err := url.Parse(p.Endpoint)
	if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" {
		return Payload{}, errors.New("payload.endpoint must be an http(s) URL of the BMC")
	}
	if u.User != nil {
		return Payload{}, errors.New("payload.endpoint must not carry credentials; name a credentials reference instead")
	}
	if p.SystemID == "" {
		p.SystemID = "1"
	}
	if !systemIDRE.MatchString(p.SystemID) {
		return Payload{}, errors.New("payload.system_id must be 1..64 of [A-Za-z0-9._-]")
	}
	if !credRefRE.MatchString(p.Credentials) {
		return Payload{}, errors.New("payload.credentials must name a credentials reference (1..128 of [A-Za-z0-9._:/-])")
	}
	if p.ResetType != "" && !resetRE.MatchString(p.ResetType) {
		return Payload{}, errors.New("payload.reset_type must be a Redfish reset type such as GracefulShutdown")
	}
	return p, nil
}

// Run executes a BMC command and returns a short, secret-free output.
func (c *Client) Run(ctx context.Context, kind string, payload []byte) ([]byte, error) {
	if !Handles(kind) {
		return nil, fmt.Errorf("unknown BMC command kind %q", kind)
	}
	p, err := ParsePayload(payload)
	if err != nil {
		return nil, err
	}
	if (kind == KindPowerReset) != (p.ResetType != "") {
		return nil, fmt.Errorf("payload.reset_type is required by %s and only by it", KindPowerReset)
	}
	c.mu.RLock()
	cred, ok := c.creds[p.Credentials]
	c.mu.RUnlock()
	if !ok {
		return nil, fmt.Errorf("credentials reference %q is not configured on this agent", p.Credentials)
	}
	b := &bmcCall{c: c, p: p, cred: cred, kind: kind, base: strings.TrimRight(p.Endpoint, "/")}
	systemPath := "/redfish/v1/Systems/" + url.PathEscape(p.SystemID)
	sys, etag, err := b.getSystem(ctx, systemPath)
	if err != nil {
		return nil, err
	}
	switch kind {
	case KindPXEOnce, KindHTTPOnce:
		target := map[string]string{KindPXEOnce: "Pxe", KindHTTPOnce: "UefiHttp"}[kind]
		if allowed := sys.Boot.AllowedTargets; len(allowed) > 0 && !slices.Contains(allowed, target) {
			return nil, fmt.Errorf("%s: the BMC does not offer boot override target %s (it offers %s)", kind, target, strings.Join(allowed, ", "))
		}
		boot := map[string]string{"BootSourceOverrideTarget": target, "BootSourceOverrideEnabled": "Once"}
		if kind == KindHTTPOnce {
			boot["BootSourceOverrideMode"] = "UEFI"
		}
		return b.patch(ctx, systemPath, etag, map[string]any{"Boot": boot})
	default:
		reset := sys.Actions.Reset
		rt, err := chooseReset(kind, p.ResetType, reset.Allowed)
		if err != nil {
			return nil, err
		}
		target := reset.Target
		if target == "" {
			target = systemPath + "/Actions/ComputerSystem.Reset"
		}
		if !strings.HasPrefix(target, "/redfish/v1/") {
			return nil, fmt.Errorf("%s: the BMC names a reset target %q outside /redfish/v1/", kind, clip(target))
		}
		return b.do(ctx, http.MethodPost, target, "", map[string]string{"ResetType": rt})
	}
}

// chooseReset picks the reset type for kind among those the BMC advertises
// (all are assumed when it advertises none).
func chooseReset(kind, asked string, allowed []string) (string, error) {
	prefs := resetPreference[kind]
	if kind == KindPowerReset {
		prefs = []string{asked}
	}
	if len(allowed) == 0 {
		return prefs[0], nil
	}
	for _, rt := range prefs {
		if slices.Contains(allowed, rt) {
			return rt, nil
		}
	}
	return "", fmt.Errorf("%s: the BMC does not offer reset type %s (it offers %s)", kind, strings.Join(prefs, " or "), strings.Join(allowed, ", "))
}

// system is the part of a ComputerSystem resource used here.
type system struct {
	ODataETag string `json:"@odata.etag"`
	Boot      struct {
		AllowedTargets []string `json:"BootSourceOverrideTarget@Redfish.AllowableValues"`
	} `json:"Boot"`
	Actions struct {
		Reset struct {
			Target  string   `json:"target"`
			Allowed []string `json:"ResetType@Redfish.AllowableValues"`
		} `json:"#ComputerSystem.Reset"`
	} `json:"Actions"`
}

// bmcCall is one command against one BMC.
type bmcCall struct {
	c    *Client
	p    Payload
	cred Credentials
	kind string
	base string
}

// getSystem reads the system resource and its ETag.
func (b *bmcCall) getSystem(ctx context.Context, path string) (system, string, error) {
	resp, body, err := b.send(ctx, http.MethodGet, path, "", nil)
	if err != nil {
		return system{}, "", err
	}
	if resp.StatusCode != http.StatusOK {
		return system{}, "", b.fail(http.MethodGet, path, resp, body)
	}
	var sys system
	if err := json.Unmarshal(body, &sys); err != nil {
		return system{}, "", fmt.Errorf("GET %s: the BMC's answer is not a Redfish ComputerSystem: %w", path, err)
	}
	etag := resp.Header.Get("ETag")
	if etag == "" {
		etag = sys.ODataETag
	}
	return sys, etag, nil
}

// patch sends a PATCH with If-Match; a 412 (the resource changed since it
// was read) re-reads the ETag and retries once.
func (b *bmcCall) patch(ctx context.Context, path, etag string, body any) ([]byte, error) {
	for attempt := 0; ; attempt++ {
		resp, msg, err := b.send(ctx, http.MethodPatch, path, etag, body)
		if err != nil {
			return nil, err
		}
		if resp.StatusCode == http.StatusPreconditionFailed && attempt == 0 {
			b.c.log.Info("redfish: resource changed since it was read (412); re-reading its ETag", "endpoint", b.p.Endpoint, "path", path)
			if _, etag, err = b.getSystem(ctx, path); err != nil {
				return nil, err
			}
			continue
		}
		if resp.StatusCode < 200 || resp.StatusCode > 299 {
			return nil, b.fail(http.MethodPatch, path, resp, msg)
		}
		return []byte(fmt.Sprintf("%s %s: %s", http.MethodPatch, b.base+path, resp.Status)), nil
	}
}

// do sends a call and turns a non-2xx answer into an error.
func (b *bmcCall) do(ctx context.Context, method, path, etag string, body any) ([]byte, error) {
	resp, msg, err := b.send(ctx, method, path, etag, body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return nil, b.fail(method, path, resp, msg)
	}
	return []byte(fmt.Sprintf("%s %s: %s", method, b.base+path, resp.Status)), nil
}

// send makes one authenticated call; a 401 with a session opens a new
// session and retries once.
func (b *bmcCall) send(ctx context.Context, method, path, etag string, body any) (*http.Response, []byte, error) {
	for attempt := 0; ; attempt++ {
		s, err := b.c.session(ctx, b)
		if err != nil {
			return nil, nil, err
		}
		resp, msg, err := b.raw(ctx, method, path, etag, body, s)
		if err != nil {
			return nil, nil, err
		}
		if resp.StatusCode == http.StatusUnauthorized && !s.basic && attempt == 0 {
			b.c.log.Info("redfish session refused (401); opening a new one", "endpoint", b.p.Endpoint, "credentials_ref", b.p.Credentials)
			b.c.dropSession(b, s)
			continue
		}
		return resp, msg, nil
	}
}

// raw makes one HTTP call with the session's token (or Basic).
func (b *bmcCall) raw(ctx context.Context, method, path, etag string, body any, s *session) (*http.Response, []byte, error) {
	var rd io.Reader
	if body != nil {
		j, _ := json.Marshal(body)
		rd = bytes.NewReader(j)
	}
	req, err := http.NewRequestWithContext(ctx, method, b.base+path, rd)
	if err != nil {
		return nil, nil, fmt.Errorf("%s %s: build request", method, path)
	}
	req.Header.Set("Accept", "application/json")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if etag != "" {
		req.Header.Set("If-Match", etag)
	}
	switch {
	case s == nil:
	case s.basic:
		req.SetBasicAuth(b.cred.Username, b.cred.Password)
	default:
		req.Header.Set("X-Auth-Token", s.token)
	}
	start := time.Now()
	resp, err := b.c.http.Do(req)
	if err != nil {
		b.c.log.Warn("redfish call failed", "kind", b.kind, "method", method, "endpoint", b.p.Endpoint, "path", path,
			"system", b.p.SystemID, "credentials_ref", b.p.Credentials, "err", scrub(err, b.cred))
		return nil, nil, fmt.Errorf("%s %s: %w", method, b.base+path, scrub(err, b.cred))
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	b.c.log.Info("redfish call", "kind", b.kind, "method", method, "endpoint", b.p.Endpoint, "path", path, "system", b.p.SystemID,
		"credentials_ref", b.p.Credentials, "status", resp.StatusCode, "took", time.Since(start).Round(time.Millisecond))
	return resp, msg, nil
}

// fail turns a BMC's error answer into an error, reading a Redfish error
// body when there is one, and logs it.
func (b *bmcCall) fail(method, path string, resp *http.Response, body []byte) error {
	detail := redfishError(body)
	if detail == "" {
		detail = strings.TrimSpace(string(body))
	}
	detail = scrubString(detail, b.cred)
	if resp.StatusCode == http.StatusPreconditionRequired {
		detail = "the BMC requires If-Match and no ETag was available: " + detail
	}
	b.c.log.Warn("redfish call refused by the BMC", "kind", b.kind, "method", method, "endpoint", b.p.Endpoint, "path", path,
		"status", resp.StatusCode, "error", detail)
	return fmt.Errorf("%s %s: BMC answered %s: %s", method, b.base+path, resp.Status, detail)
}

// redfishError renders a Redfish error body ({"error": {"code", "message",
// "@Message.ExtendedInfo": [{"MessageId", "Message", "Resolution"}]}}) as
// one line, or "" when body is not one.
func redfishError(body []byte) string {
	var e struct {
		Error struct {
			Code     string `json:"code"`
			Message  string `json:"message"`
			Extended []struct {
				MessageID  string `json:"MessageId"`
				Message    string `json:"Message"`
				Resolution string `json:"Resolution"`
			} `json:"@Message.ExtendedInfo"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &e) != nil || (e.Error.Code == "" && e.Error.Message == "" && len(e.Error.Extended) == 0) {
		return ""
	}
	parts := []string{}
	if e.Error.Code != "" {
		parts = append(parts, e.Error.Code)
	}
	if e.Error.Message != "" {
		parts = append(parts, e.Error.Message)
	}
	for _, x := range e.Error.Extended {
		s := strings.TrimSpace(x.MessageID + ": " + x.Message)
		if x.Resolution != "" {
			s += " (resolution: " + x.Resolution + ")"
		}
		parts = append(parts, s)
	}
	return clip(strings.Join(parts, "; "))
}

// session returns the open session for b's BMC and account, opening one
// when there is none.
func (c *Client) session(ctx context.Context, b *bmcCall) (*session, error) {
	key := sessionKey{b.base, b.p.Credentials}
	c.mu.RLock()
	s := c.sessions[key]
	c.mu.RUnlock()
	if s != nil {
		return s, nil
	}
	const path = "/redfish/v1/SessionService/Sessions"
	resp, body, err := b.raw(ctx, http.MethodPost, path, "", map[string]string{"UserName": b.cred.Username, "Password": b.cred.Password}, nil)
	if err != nil {
		return nil, err
	}
	switch resp.StatusCode {
	case http.StatusCreated, http.StatusOK:
		tok := resp.Header.Get("X-Auth-Token")
		if tok == "" {
			return nil, fmt.Errorf("POST %s: the BMC opened a session without an X-Auth-Token", b.base+path)
		}
		s = &session{token: tok, location: resp.Header.Get("Location")}
		c.log.Info("redfish session opened", "endpoint", b.p.Endpoint, "credentials_ref", b.p.Credentials)
	case http.StatusNotFound, http.StatusMethodNotAllowed, http.StatusNotImplemented:
		s = &session{basic: true}
		c.log.Warn("BMC has no Redfish session service; using Basic authentication on every call", "endpoint", b.p.Endpoint, "status", resp.StatusCode)
	default:
		return nil, b.fail(http.MethodPost, path, resp, body)
	}
	c.mu.Lock()
	c.sessions[key] = s
	c.mu.Unlock()
	return s, nil
}

// dropSession forgets s (the BMC refused it) so the next call opens another.
func (c *Client) dropSession(b *bmcCall, s *session) {
	key := sessionKey{b.base, b.p.Credentials}
	c.mu.Lock()
	if c.sessions[key] == s {
		delete(c.sessions, key)
	}
	c.mu.Unlock()
}

// Close ends every open session (DELETE of its location), best effort.
func (c *Client) Close(ctx context.Context) {
	c.mu.Lock()
	sessions := c.sessions
	c.sessions = map[sessionKey]*session{}
	c.mu.Unlock()
	for key, s := range sessions {
		if s.basic || s.location == "" {
			continue
		}
		loc := s.location
		if strings.HasPrefix(loc, "/") {
			loc = key.endpoint + loc
		}
		if !strings.HasPrefix(loc, key.endpoint+"/") {
			continue // never send the token elsewhere
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodDelete, loc, nil)
		if err != nil {
			continue
		}
		req.Header.Set("X-Auth-Token", s.token)
		if resp, err := c.http.Do(req); err == nil {
			_ = resp.Body.Close()
		}
	}
}

func clip(s string) string {
	s = strings.ToValidUTF8(s, "?")
	if len(s) > 512 {
		return s[:512] + "…"
	}
	return s
}

// scrub removes the secret from an error's text, should a transport ever
// quote it.
func scrub(err error, cred Credentials) error {
	return errors.New(scrubString(err.Error(), cred))
}

func scrubString(s string, cred Credentials) string {
	if cred.Password != "" {
		s = strings.ReplaceAll(s, cred.Password, "[redacted]")
	}
	if len(s) > 512 {
		s = s[:512] + "…"
	}
	return s
}
