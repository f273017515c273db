package api

import (
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/leasehold/leasehold/pkg/apiauth"
	"github.com/leasehold/leasehold/pkg/egress"
	"github.com/leasehold/leasehold/pkg/lifecycle"
	"github.com/leasehold/leasehold/pkg/reload"
)

// TokensEnv is the environment variable holding inline API tokens
// ("role:token" or "role:sha256:<hex>", separated by commas or newlines). It
// is read directly, never through a flag, so tokens stay off command lines.
const TokensEnv = "LEASEHOLD_API_TOKENS"

// Limits of the API's configuration and requests.
const (
	// MaxWait caps WaitCommand's timeout; DefaultWait applies when unset.
	MaxWait     = 60 * time.Second
	DefaultWait = 30 * time.Second
	// MinCommandTimeout and MaxCommandTimeout bound a command's life.
	MinCommandTimeout = time.Second
	MaxCommandTimeout = 7 * 24 * time.Hour
	// DefaultMaxQueuedPerNode is --api.max-queued-per-node's default: far
	// above what a node works through (its gateway keeps 32 in flight),
	// far below what would slow the node's dispatch.
	DefaultMaxQueuedPerNode = 1000
	// DefaultCreateGroup is --api.create-group's default.
	DefaultCreateGroup = 256
	// maxCreateGroup bounds --api.create-group.
	maxCreateGroup = 4096
	// maxQueuedPerNode bounds the flag: counting a full queue costs an
	// index entry per queued command on every create for the node.
	maxQueuedPerNode = 100000
)

// Config is the api service's configuration.
type Config struct {
	// ListenAddr serves ControlService (HTTP/1.1 and HTTP/2: h2c, or TLS).
	ListenAddr string
	// TokensFile holds "role:token" lines; see package apiauth.
	TokensFile string
	// Tokens is the inline token list (main sets it from LEASEHOLD_API_TOKENS).
	Tokens string
	// TLSCert and TLSKey serve TLS when both are set.
	TLSCert, TLSKey string
	// MaxMessageBytes refuses larger requests with RESOURCE_EXHAUSTED.
	MaxMessageBytes int
	// RateLimit and RateBurst bound each caller's calls per second on one
	// replica (per token; per source address for enrollment); 0 turns the
	// limit off.
	RateLimit float64
	RateBurst int
	// MaxPayloadBytes bounds a command's payload (CreateCommand,
	// INVALID_ARGUMENT past it); at most MaxMessageBytes less 64 KiB of
	// envelope.
	MaxPayloadBytes int
	// MaxQueuedPerNode refuses CreateCommand (RESOURCE_EXHAUSTED) for a
	// node that already has this many commands pending; 0 turns it off.
	MaxQueuedPerNode int
	// OverloadAdmission refuses CreateCommand (RESOURCE_EXHAUSTED) for a
	// node whose gateway reports overload (gateway_load).
	OverloadAdmission bool
	// CreateGroup is the most creates without an idempotency key written
	// in one transaction (createbatch.go); 1 writes each alone.
	CreateGroup int
	// DefaultCommandTimeout is a command's life when the request sets none.
	DefaultCommandTimeout time.Duration
	// WaitPollInterval is how often WaitCommand checks its commands when no
	// notification comes: the fallback of the LISTEN on finished commands.
	WaitPollInterval time.Duration
	// ShutdownGrace bounds how long in-flight calls may finish on stop.
	ShutdownGrace time.Duration
	// SinkEgress says which non-public sink URLs CreateSink accepts.
	SinkEgress egress.Policy
	// ReloadInterval is how often the tokens file and the TLS files are
	// re-read; a change takes effect without a restart (0: 10s).
	ReloadInterval time.Duration
	// RelayTokenFile holds the shared bearer token of the gateways' tunnel
	// relays (their --gateway.relay-token-file), re-read on change.
	// OpenTunnel is refused unless it or RelayTLS is set.
	RelayTokenFile string
	// RelayTLS dials the relays over TLS: their certificates must chain to
	// RelayTLS.CA and name RelayServerName (or the address dialled), and
	// RelayTLS.Cert is the api's client certificate under the gateways'
	// --gateway.relay-tls.client-ca-file. Re-read on change.
	RelayTLS reload.ClientTLSFiles
	// RelayServerName is the name every relay certificate must carry
	// ("": the host of the address the gateway published).
	RelayServerName string
	// ReadDatabaseURL names a hot standby (a server in recovery) that
	// serves the paginated list RPCs; "" serves everything from the
	// primary. See readReplica for when a list still goes to the primary.
	ReadDatabaseURL string
	// ReadPooler marks ReadDatabaseURL as going through a transaction-mode
	// pooler: no startup parameters, no statement cache.
	ReadPooler bool
	// ReadReplicaMaxLag is the replay lag past which lists go to the
	// primary until the replica is back under it (0: 5s).
	ReadReplicaMaxLag time.Duration

	// readProbeInterval is how often the replica is probed (0:
	// readProbeInterval); tests shorten it.
	readProbeInterval time.Duration
}

// RegisterFlags registers the api flags on f, each name under prefix.
func (c *Config) RegisterFlags(prefix string, f *flag.FlagSet) {
	f.StringVar(&c.ListenAddr, prefix+"listen-addr", "127.0.0.1:8080", "address of ControlService (Connect, gRPC and gRPC-Web; HTTP/1.1 and h2c, or TLS)")
	f.StringVar(&c.TokensFile, prefix+"tokens-file", "", "file of API tokens, one \"role:token\" or \"role:sha256:<hex>\" per line (also "+TokensEnv+")")
	f.StringVar(&c.TLSCert, prefix+"api.tls-cert", "", "TLS certificate of --listen-addr (PEM); with --api.tls-key")
	f.StringVar(&c.TLSKey, prefix+"api.tls-key", "", "TLS key of --listen-addr (PEM)")
	f.IntVar(&c.MaxMessageBytes, prefix+"api.max-message-bytes", 4<<20, "largest request message accepted")
	f.Float64Var(&c.RateLimit, prefix+"api.rate-limit", 200, "calls per second each token may make to this replica (enrollment: each source address); past it RESOURCE_EXHAUSTED with Retry-After; 0 turns it off")
	f.IntVar(&c.RateBurst, prefix+"api.rate-burst", 400, "calls a token may make at once above --api.rate-limit")
	f.IntVar(&c.MaxPayloadBytes, prefix+"api.max-payload-bytes", maxPayloadBytes, "largest command payload accepted (a file.put's content travels in it, base64 in its JSON); at most --api.max-message-bytes less 64 KiB; the default is the gateways' default --gateway.max-message-bytes less 4 KiB of envelope, so raise both together")
	f.IntVar(&c.MaxQueuedPerNode, prefix+"api.max-queued-per-node", DefaultMaxQueuedPerNode, "CreateCommand refuses (RESOURCE_EXHAUSTED) a command for a node with this many commands pending already: a runaway caller cannot pile unbounded work on one node, an offline one above all; 0 turns it off")
	f.IntVar(&c.CreateGroup, prefix+"api.create-group", DefaultCreateGroup, "the most CreateCommand calls without an idempotency key written in one transaction: calls that arrive while another group is being written share the next, so a busy api commits once for many commands; 1 writes each alone")
	f.BoolVar(&c.OverloadAdmission, prefix+"api.overload-admission", true, "CreateCommand refuses (RESOURCE_EXHAUSTED) a command for a node whose gateway reports overload (--gateway.overload-lag), so a backlog cannot outgrow what the gateways complete; false admits everything")
	f.DurationVar(&c.DefaultCommandTimeout, prefix+"api.default-command-timeout", time.Hour, "life of a command created without deadline or timeout")
	f.DurationVar(&c.WaitPollInterval, prefix+"api.wait-poll-interval", time.Second, "how often WaitCommand checks for finished commands when no notification comes (gateways NOTIFY when they finish commands)")
	f.DurationVar(&c.ShutdownGrace, prefix+"api.shutdown-grace", 10*time.Second, "how long in-flight calls may finish on SIGTERM")
	c.SinkEgress.LoopbackFlag, c.SinkEgress.PrivateFlag = "--api.sink-allow-loopback", "--api.sink-allow-private"
	f.BoolVar(&c.SinkEgress.AllowLoopback, prefix+"api.sink-allow-loopback", false, "accept sink URLs on loopback (tests and single-machine development only)")
	f.BoolVar(&c.SinkEgress.AllowPrivate, prefix+"api.sink-allow-private", false, "accept sink URLs on private addresses (RFC 1918, 100.64.0.0/10, fc00::/7); metadata and link-local stay refused")
	f.StringVar(&c.RelayTokenFile, prefix+"api.relay-token-file", "", "file holding the shared token of the gateways' tunnel relays (--gateway.relay-token-file), re-read on change; without it and without --api.relay-tls.* files OpenTunnel is refused")
	f.StringVar(&c.RelayTLS.CA, prefix+"api.relay-tls.ca-file", "", "CA bundle (PEM) the gateways' relay certificates must chain to (dials the relays over TLS); re-read on change")
	f.StringVar(&c.RelayTLS.Cert, prefix+"api.relay-tls.cert-file", "", "client certificate (PEM) the api presents to the relays (their --gateway.relay-tls.client-ca-file), with --api.relay-tls.key-file; re-read on change")
	f.StringVar(&c.RelayTLS.Key, prefix+"api.relay-tls.key-file", "", "key (PEM) of --api.relay-tls.cert-file")
	f.StringVar(&c.RelayServerName, prefix+"api.relay-tls.server-name", "", "name every relay certificate must carry (default: the host of the address each gateway published)")
	f.StringVar(&c.ReadDatabaseURL, prefix+"api.read-database-url", "", "PostgreSQL URL of a hot standby that serves ListNodes, ListCommands, ListRuns, ListAuditEvents, ListPools and ListPoolLeases (every other call stays on --database-url); a list goes to the primary while the standby is unreachable or lags past --api.read-replica-max-lag")
	f.BoolVar(&c.ReadPooler, prefix+"api.read-pooler", false, "--api.read-database-url goes through PgBouncer in transaction mode")
	f.DurationVar(&c.ReadReplicaMaxLag, prefix+"api.read-replica-max-lag", 5*time.Second, "replay lag of --api.read-database-url past which lists go to the primary until it is back under")
	f.DurationVar(&c.ReloadInterval, prefix+"api.reload-interval", 10*time.Second, "how often --tokens-file, --api.tls-cert and --api.tls-key are re-read (a change applies without restart)")
}

// Listeners lists the api's listener for lifecycle.CheckPlaintext.
func (c *Config) Listeners() []lifecycle.Listener {
	return []lifecycle.Listener{{Flag: "listen-addr", Addr: c.ListenAddr, TLS: c.TLSCert != "", TLSFlag: "api.tls-cert"}}
}

// Validate checks the configuration, naming the offending flag, and loads
// the tokens so a bad tokens file stops the process at start.
func (c *Config) Validate() error {
	var errs []error
	if c.ListenAddr == "" {
		errs = append(errs, errors.New("--listen-addr is required"))
	}
	if (c.TLSCert == "") != (c.TLSKey == "") {
		errs = append(errs, errors.New("--api.tls-cert and --api.tls-key go together"))
	}
	if (c.RelayTLS.Cert == "") != (c.RelayTLS.Key == "") {
		errs = append(errs, errors.New("--api.relay-tls.cert-file and --api.relay-tls.key-file go together"))
	}
	if c.RelayServerName != "" && c.RelayTLS.Empty() {
		errs = append(errs, errors.New("--api.relay-tls.server-name needs --api.relay-tls.ca-file (or a client certificate): it names the relays' TLS certificates"))
	}
	if c.MaxMessageBytes < 1024 || c.MaxMessageBytes > 64<<20 {
		errs = append(errs, fmt.Errorf("--api.max-message-bytes %d must be in 1024..%d", c.MaxMessageBytes, 64<<20))
	}
	if c.RateLimit < 0 || (c.RateLimit > 0 && c.RateBurst < 1) {
		errs = append(errs, fmt.Errorf("--api.rate-limit %g must not be negative and --api.rate-burst %d must be at least 1", c.RateLimit, c.RateBurst))
	}
	if c.MaxPayloadBytes < 1024 || c.MaxPayloadBytes > c.MaxMessageBytes-64<<10 {
		errs = append(errs, fmt.Errorf("--api.max-payload-bytes %d must be in 1024..--api.max-message-bytes less 64 KiB (%d)", c.MaxPayloadBytes, c.MaxMessageBytes-64<<10))
	}
	if c.MaxQueuedPerNode < 0 || c.MaxQueuedPerNode > maxQueuedPerNode {
		errs = append(errs, fmt.Errorf("--api.max-queued-per-node %d must be in 0..%d (0: no cap)", c.MaxQueuedPerNode, maxQueuedPerNode))
	}
	if c.CreateGroup < 1 || c.CreateGroup > maxCreateGroup {
		errs = append(errs, fmt.Errorf("--api.create-group %d must be in 1..%d (1: each create alone)", c.CreateGroup, maxCreateGroup))
	}
	if c.DefaultCommandTimeout < MinCommandTimeout || c.DefaultCommandTimeout > MaxCommandTimeout {
		errs = append(errs, fmt.Errorf("--api.default-command-timeout %s must be in %s..%s", c.DefaultCommandTimeout, MinCommandTimeout, MaxCommandTimeout))
	}
	if c.WaitPollInterval < 10*time.Millisecond || c.WaitPollInterval > 10*time.Second {
		errs = append(errs, fmt.Errorf("--api.wait-poll-interval %s must be in 10ms..10s", c.WaitPollInterval))
	}
	if c.ShutdownGrace <= 0 || c.ShutdownGrace > 5*time.Minute {
		errs = append(errs, fmt.Errorf("--api.shutdown-grace %s must be in (0, 5m]", c.ShutdownGrace))
	}
	if c.ReloadInterval < 0 || c.ReloadInterval > time.Hour {
		errs = append(errs, fmt.Errorf("--api.reload-interval %s must be in [0, 1h] (0: 10s)", c.ReloadInterval))
	}
	if c.ReadDatabaseURL != "" {
		if _, err := readPoolConfig(*c, "", 0); err != nil {
			errs = append(errs, err)
		}
	}
	if c.ReadReplicaMaxLag != 0 && (c.ReadReplicaMaxLag < 100*time.Millisecond || c.ReadReplicaMaxLag > time.Hour) {
		errs = append(errs, fmt.Errorf("--api.read-replica-max-lag %s must be in 100ms..1h (0: 5s)", c.ReadReplicaMaxLag))
	}
	if k, err := c.Keyring(); err != nil {
		errs = append(errs, err)
	} else if k.Len() == 0 {
		errs = append(errs, fmt.Errorf("no API tokens: give --tokens-file (LEASEHOLD_TOKENS_FILE) or %s", TokensEnv))
	}
	return errors.Join(errs...)
}

// Keyring loads the configured tokens.
func (c *Config) Keyring() (*apiauth.Keyring, error) {
	return apiauth.Load(c.TokensFile, c.Tokens, TokensEnv)
}
