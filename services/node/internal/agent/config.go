package agent

import (
	"errors"
	"flag"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/nodeexec"
	"github.com/leasehold/leasehold/pkg/reload"
)

// DefaultStateDir is where the agent keeps its credential, node id and
// journal unless --state-dir says otherwise.
const DefaultStateDir = "/var/lib/leasehold-node"

// Config is leasehold-node's configuration (docs/node.md).
type Config struct {
	// GatewayURL is the gateway (balancer) base URL: https:// for TLS,
	// http:// for h2c on a trusted network.
	GatewayURL string
	// StateDir holds the credential, the node id and the journal.
	StateDir string
	// NodeID is the node's id; empty means DefaultNodeID.
	NodeID string
	// CredentialFile holds the credential; empty means <state-dir>/credential.
	CredentialFile string
	// Labels are reported in Hello (the control plane's assigned labels win).
	Labels Labels
	// TLS names the CA bundle and the client certificate, re-read on change.
	TLS reload.ClientTLSFiles
	// BackoffMax bounds the redial back-off.
	BackoffMax time.Duration
	// MaxMessageBytes bounds a message read from the gateway (a command
	// with its payload); keep it at or above the gateway's
	// --gateway.max-message-bytes.
	MaxMessageBytes int
	// MaxOutputBytes is how much live output of one command is sent at
	// most; keep it above the gateway's --gateway.output-cap.
	MaxOutputBytes int64

	// TunnelPorts are the loopback ports operators may forward to.
	TunnelPorts Ports
	// TunnelShell is the shell a shell tunnel runs (argv, split on
	// spaces); empty refuses shell tunnels.
	TunnelShell string
	// TunnelShellUser runs the tunnel shell as this user; empty means the
	// agent's own.
	TunnelShellUser string

	// Exec configures the executor of the typed command kinds.
	Exec nodeexec.Config
}

// RegisterFlags registers the flags on f with their defaults.
func (c *Config) RegisterFlags(f *flag.FlagSet) {
	f.StringVar(&c.GatewayURL, "gateway-url", "http://127.0.0.1:9443", "gateway (balancer) base URL: https:// for TLS, http:// for h2c")
	f.StringVar(&c.StateDir, "state-dir", DefaultStateDir, "directory of the credential, the node id and the journal (created 0700)")
	f.StringVar(&c.NodeID, "node-id", "", "this node's id (default: the id it joined as, else the short hostname, else /etc/machine-id)")
	f.StringVar(&c.CredentialFile, "node-credential-file", "", "file holding the node credential, mode 0600 (default <state-dir>/credential, written by leasehold-node join)")
	f.Var(&c.Labels, "label", "label reported by this node, key=value (repeatable)")
	c.TLS.RegisterFlags("", f)
	f.DurationVar(&c.BackoffMax, "redial-backoff-max", 60*time.Second, "upper bound of the redial back-off")
	f.IntVar(&c.MaxMessageBytes, "max-message-bytes", 4<<20, "largest message read from the gateway (a command and its payload); at least the gateway's --gateway.max-message-bytes")
	f.Int64Var(&c.MaxOutputBytes, "output.max-bytes", 256<<20, "live output of one command sent at most (stdout and stderr together): the gateway stores its first --gateway.output-cap bytes and relays all of it to live readers")
	f.Var(&c.TunnelPorts, "tunnel.ports", "comma-separated loopback TCP ports operators may forward to (default none)")
	f.StringVar(&c.TunnelShell, "tunnel.shell", "", `shell run by shell tunnels, e.g. "/bin/bash -l" (default: shell tunnels refused)`)
	f.StringVar(&c.TunnelShellUser, "tunnel.shell-user", "", "user the tunnel shell runs as (default: the agent's user)")
	c.Exec = nodeexec.DefaultConfig()
	c.Exec.RegisterFlags("", f)
}

// Resolve fills the defaults that depend on other flags and validates.
func (c *Config) Resolve() error {
	if c.CredentialFile == "" {
		c.CredentialFile = filepath.Join(c.StateDir, credentialFileName)
	}
	if c.NodeID == "" {
		id, err := DefaultNodeID(c.StateDir)
		if err != nil {
			return fmt.Errorf("--node-id: %w", err)
		}
		c.NodeID = id
	}
	if err := c.Validate(); err != nil {
		return err
	}
	// Refused here, with the other configuration errors (exit 2, which the
	// unit does not restart), when the machine cannot do what the operator
	// required; New sets the cgroups up.
	if c.Exec.Cgroup == nodeexec.CgroupRequired {
		if err := nodeexec.CheckCgroups(c.Exec); err != nil {
			return fmt.Errorf("--exec.cgroup=required: %w", err)
		}
	}
	// A missing or exposed credential is a configuration error: refuse to
	// start, naming the file. Every Hello reads it again (rotation).
	_, err := ReadCredential(c.CredentialFile)
	return err
}

// Validate refuses bad values, naming the flag.
func (c *Config) Validate() error {
	var errs []error
	if !strings.HasPrefix(c.GatewayURL, "http://") && !strings.HasPrefix(c.GatewayURL, "https://") {
		errs = append(errs, fmt.Errorf("--gateway-url %q must start with https:// (TLS) or http:// (h2c)", c.GatewayURL))
	}
	if err := c.TLS.Validate("", c.GatewayURL); err != nil {
		errs = append(errs, err)
	}
	if c.StateDir == "" || !filepath.IsAbs(c.StateDir) {
		errs = append(errs, fmt.Errorf("--state-dir %q must be an absolute path", c.StateDir))
	}
	if err := nodeauth.ValidateNodeID(c.NodeID); err != nil {
		errs = append(errs, fmt.Errorf("--node-id: %w", err))
	}
	if c.BackoffMax < 100*time.Millisecond {
		errs = append(errs, fmt.Errorf("--redial-backoff-max %s must be >= 100ms", c.BackoffMax))
	}
	if c.MaxMessageBytes < 64<<10 || c.MaxMessageBytes > 256<<20 {
		errs = append(errs, fmt.Errorf("--max-message-bytes %d must be within 64 KiB..256 MiB", c.MaxMessageBytes))
	}
	if c.MaxOutputBytes < 0 {
		errs = append(errs, fmt.Errorf("--output.max-bytes %d must not be negative", c.MaxOutputBytes))
	}
	if strings.TrimSpace(c.TunnelShell) != "" && !filepath.IsAbs(strings.Fields(c.TunnelShell)[0]) {
		errs = append(errs, fmt.Errorf("--tunnel.shell %q must start with an absolute path", c.TunnelShell))
	}
	if err := c.Exec.Validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Labels is a repeatable key=value flag.
type Labels map[string]string

// String implements flag.Value.
func (l *Labels) String() string {
	if l == nil || len(*l) == 0 {
		return ""
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(*l)) {
		parts = append(parts, k+"="+(*l)[k])
	}
	return strings.Join(parts, ",")
}

// Set implements flag.Value: one key=value, or several separated by commas.
func (l *Labels) Set(s string) error {
	if *l == nil {
		*l = Labels{}
	}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
		if !ok || k == "" {
			return fmt.Errorf("label %q must be key=value", kv)
		}
		(*l)[k] = v
	}
	return nil
}

// Ports is a comma-separated list of TCP ports.
type Ports []uint32

// String implements flag.Value.
func (p *Ports) String() string {
	if p == nil {
		return ""
	}
	s := make([]string, len(*p))
	for i, v := range *p {
		s[i] = strconv.Itoa(int(v))
	}
	return strings.Join(s, ",")
}

// Set implements flag.Value; it replaces the list.
func (p *Ports) Set(s string) error {
	*p = nil
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 || n > 65535 {
			return fmt.Errorf("port %q must be 1..65535", f)
		}
		*p = append(*p, uint32(n))
	}
	return nil
}
