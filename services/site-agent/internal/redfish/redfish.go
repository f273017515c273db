// Package redfish drives BMC power and boot through Redfish, for node
// commands addressed to a site agent:
//
//	power.on       POST {system}/Actions/ComputerSystem.Reset {"ResetType":"On"}
//	power.off      POST {system}/Actions/ComputerSystem.Reset {"ResetType":"ForceOff"}
//	power.cycle    POST {system}/Actions/ComputerSystem.Reset {"ResetType":"ForceRestart"}
//	boot.pxe-once  PATCH {system} {"Boot":{"BootSourceOverrideTarget":"Pxe","BootSourceOverrideEnabled":"Once"}}
//
// where {system} is /redfish/v1/Systems/{id}. A command's payload names the
// BMC and a credentials reference, never a secret:
//
//	{"endpoint":"https://10.0.0.5","system_id":"1","credentials":"rack1-bmc"}
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
	"strings"
	"sync"
	"time"
)

// Command kinds handled here.
const (
	KindPowerOn    = "power.on"
	KindPowerOff   = "power.off"
	KindPowerCycle = "power.cycle"
	KindPXEOnce    = "boot.pxe-once"
)

// Handles reports whether kind is a BMC command.
func Handles(kind string) bool {
	switch kind {
	case KindPowerOn, KindPowerOff, KindPowerCycle, KindPXEOnce:
		return true
	}
	return false
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
}

var (
	systemIDRE = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)
	credRefRE  = regexp.MustCompile(`^[A-Za-z0-9._:/-]{1,128}$`)
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

	mu    sync.RWMutex
	creds map[string]Credentials
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
		log: log, creds: map[string]Credentials{}}
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
	return p, nil
}

// Run executes a BMC command and returns a short, secret-free output.
func (c *Client) Run(ctx context.Context, kind string, payload []byte) ([]byte, error) {
	p, err := ParsePayload(payload)
	if err != nil {
		return nil, err
	}
	c.mu.RLock()
	cred, ok := c.creds[p.Credentials]
	c.mu.RUnlock()
	if !ok {
		return nil, fmt.Errorf("credentials reference %q is not configured on this agent", p.Credentials)
	}
	system := strings.TrimRight(p.Endpoint, "/") + "/redfish/v1/Systems/" + url.PathEscape(p.SystemID)
	var (
		method, target string
		body           any
	)
	switch kind {
	case KindPowerOn, KindPowerOff, KindPowerCycle:
		reset := map[string]string{KindPowerOn: "On", KindPowerOff: "ForceOff", KindPowerCycle: "ForceRestart"}[kind]
		method, target, body = http.MethodPost, system+"/Actions/ComputerSystem.Reset", map[string]string{"ResetType": reset}
	case KindPXEOnce:
		method, target, body = http.MethodPatch, system, map[string]any{"Boot": map[string]string{
			"BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Once"}}
	default:
		return nil, fmt.Errorf("unknown BMC command kind %q", kind)
	}
	b, _ := json.Marshal(body)
	req, err := http.NewRequestWithContext(ctx, method, target, bytes.NewReader(b))
	if err != nil {
		return nil, fmt.Errorf("%s %s: build request", method, target)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json")
	req.SetBasicAuth(cred.Username, cred.Password)
	start := time.Now()
	resp, err := c.http.Do(req)
	if err != nil {
		c.log.Warn("redfish call failed", "kind", kind, "endpoint", p.Endpoint, "system", p.SystemID, "credentials_ref", p.Credentials, "err", scrub(err, cred))
		return nil, fmt.Errorf("%s %s: %v", method, target, scrub(err, cred))
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	c.log.Info("redfish call", "kind", kind, "endpoint", p.Endpoint, "system", p.SystemID, "credentials_ref", p.Credentials,
		"status", resp.StatusCode, "took", time.Since(start).Round(time.Millisecond))
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return nil, fmt.Errorf("%s %s: BMC answered %s: %s", method, target, resp.Status, scrubString(strings.TrimSpace(string(msg)), cred))
	}
	return []byte(fmt.Sprintf("%s %s: %s", method, target, resp.Status)), nil
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
