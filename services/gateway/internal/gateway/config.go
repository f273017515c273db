package gateway

import (
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/leasehold/leasehold/pkg/buildinfo"
	"github.com/leasehold/leasehold/pkg/cmdkind"
	"github.com/leasehold/leasehold/pkg/lifecycle"
	"github.com/leasehold/leasehold/pkg/reload"
)

// Config is the gateway's own configuration (docs/design.md#gateways and #timings).
type Config struct {
	// ListenAddr serves node streams (HTTP/2: h2c, or TLS when TLSCert is set).
	ListenAddr string
	// TLSCert and TLSKey are PEM files; both or neither.
	TLSCert, TLSKey string
	// TLSClientCA, when set, requires and verifies a client certificate (mTLS).
	TLSClientCA string
	// TLSBindNodeID, with TLSClientCA, binds the verified client certificate
	// to the node: a Hello whose node_id is not the node the certificate
	// names (nodeauth.NodeIDFromCert) is refused PERMISSION_DENIED before
	// the admission token, the credential or the database. Turn it off for fleets whose PKI issues host
	// certificates that name no node; the credential is required either way.
	TLSBindNodeID bool
	// TLSReloadInterval is how often the TLS files are re-read: a renewed
	// certificate or a rotated client CA serves new handshakes without a
	// restart (0: 10s).
	TLSReloadInterval time.Duration

	// LeaseTTL is the gateway lease's TTL; LeaseRenew its renewal interval.
	LeaseTTL, LeaseRenew time.Duration
	// SessionLease is how long a node session stays valid without a
	// liveness write.
	SessionLease time.Duration
	// LivenessInterval is how often one batched statement extends every
	// session this gateway holds.
	LivenessInterval time.Duration
	// HeartbeatInterval is sent in Welcome; a node silent for three
	// intervals is closed.
	HeartbeatInterval time.Duration

	// MaxStreams bounds concurrent streams (sessions and pending Hellos).
	MaxStreams int
	// MaxPendingHellos bounds the authenticated Hellos admitted at once,
	// waiting for a slot or running their transaction; at most half the
	// pool's connections run them (helloSlotsFor).
	MaxPendingHellos int
	// MaxPendingAuths bounds concurrent credential checks, the one
	// database read a Hello costs before it is authenticated; a Hello that
	// finds them all busy waits its turn (docs/gateway.md, "Admission").
	MaxPendingAuths int
	// HelloRate and HelloBurst shape the handshake token bucket.
	HelloRate  float64
	HelloBurst int
	// MaxMessageBytes refuses larger messages with RESOURCE_EXHAUSTED.
	MaxMessageBytes int

	// DispatchPoll is the dispatch poll interval when no NOTIFY arrives.
	DispatchPoll time.Duration
	// DispatchBatch bounds the commands one dispatch transaction takes.
	DispatchBatch int
	// CommitSpacing is the least time between the starts of two group
	// commits (ingest.go): what reports arrive meanwhile share the next
	// one. The first after a quiet spell is written at once; 0 writes
	// each batch as soon as the previous one is done.
	CommitSpacing time.Duration
	// NodeWindow bounds the commands a session holds unanswered (sent,
	// no result yet); the rest stay pending in the database until results
	// free room (docs/gateway.md, "The node window").
	NodeWindow int
	// OverloadLag is the lag (load.go: how long commands wait for
	// dispatch while their node has room, plus how long results wait for
	// the group commit) past which the gateway counts itself behind; 0
	// never reports overload.
	OverloadLag time.Duration
	// OverloadHold is how long the lag must stay past OverloadLag before
	// the gateway reports overload, so a burst (a failover's reconnects,
	// the minute after a database outage) is not refused.
	OverloadHold time.Duration
	// SpecPoll is how often the specs of held sessions are compared with
	// the database when no NOTIFY arrives; a newer spec is pushed as
	// NodeSpecUpdate.
	SpecPoll time.Duration

	// HelloTimeout closes a stream whose first message has not arrived in
	// time, so idle dials cannot hold stream slots.
	HelloTimeout time.Duration

	// HTTP2Server picks the HTTP/2 server of node streams: "lean"
	// (internal/h2serve: two goroutines per idle session) or "std"
	// (net/http's, the fallback).
	HTTP2Server string

	// DrainMaxDelay bounds the random Drain delay sent on SIGTERM; the
	// gateway waits at most DrainMaxDelay plus DrainGrace for streams to go.
	DrainMaxDelay, DrainGrace time.Duration

	// MinDaemonVersion, when set, refuses a Hello whose daemon_version is
	// older (semver, MAJOR.MINOR.PATCH), missing or not semantic, with
	// FAILED_PRECONDITION and a 5-10 min retry-after.
	MinDaemonVersion string
	// OutputCap is how many bytes of a command's live output are stored;
	// past it a truncation marker is stored and the rest dropped.
	OutputCap int64

	// RelayListenAddr serves GatewayRelayService, the api's tunnel relay
	// (h2c, authenticated with the shared token of RelayTokenFile); ""
	// relays no tunnels.
	RelayListenAddr string
	// RelayAdvertiseAddr is the host:port api replicas dial to reach the
	// relay (default: the address RelayListenAddr bound); it is stored in
	// gateway_relays under the gateway lease.
	RelayAdvertiseAddr string
	// RelayTokenFile holds the shared bearer token of the relay, re-read on
	// change; with RelayListenAddr it or RelayTLS.ClientCA (mTLS) is
	// required, and with both the api must pass both.
	RelayTokenFile string
	// RelayTLS serves the relay over TLS (Cert and Key); with ClientCA the
	// api must present a client certificate that CA signed and that names
	// RelayClientName (mTLS). The files are re-read on change.
	RelayTLS reload.TLSFiles
	// RelayClientName is the name (DNS SAN, else CommonName) the api's
	// relay client certificate must carry under RelayTLS.ClientCA.
	RelayClientName string
	// MaxTunnelsPerNode and MaxTunnels bound the tunnels open at once to one
	// node and through this gateway; past them OpenTunnel is refused
	// RESOURCE_EXHAUSTED naming the limit.
	MaxTunnelsPerNode, MaxTunnels int
	// TunnelIdleTimeout ends a tunnel that carried no byte either way for
	// this long (DEADLINE_EXCEEDED).
	TunnelIdleTimeout time.Duration
	// TunnelAttachTimeout bounds the wait for the daemon to connect the
	// target and attach its Tunnel stream.
	TunnelAttachTimeout time.Duration
}

// RegisterFlags registers the gateway flags on f, each name under prefix, with their defaults.
func (c *Config) RegisterFlags(prefix string, f *flag.FlagSet) {
	f.StringVar(&c.ListenAddr, prefix+"listen-addr", "127.0.0.1:9443", "address of node streams (HTTP/2; h2c unless --tls-cert is set)")
	f.StringVar(&c.TLSCert, prefix+"tls-cert", "", "PEM certificate for node streams (enables TLS)")
	f.StringVar(&c.TLSKey, prefix+"tls-key", "", "PEM private key of --tls-cert")
	f.StringVar(&c.TLSClientCA, prefix+"tls-client-ca", "", "PEM CA bundle; when set, nodes must present a client certificate it signed (mTLS)")
	f.DurationVar(&c.TLSReloadInterval, prefix+"tls-reload-interval", 10*time.Second, "how often --tls-cert, --tls-key and --tls-client-ca are re-read (new handshakes use the new files; open streams keep theirs)")
	f.BoolVar(&c.TLSBindNodeID, prefix+"gateway.tls-bind-node-id", true, "with --tls-client-ca, a Hello's node_id must be the node its client certificate names (URI SAN leasehold://node/<id>, else the CommonName); false for host certificates")
	f.DurationVar(&c.LeaseTTL, prefix+"gateway.lease-ttl", 20*time.Second, "TTL of the gateway:<id> lease")
	f.DurationVar(&c.LeaseRenew, prefix+"gateway.lease-renew", 5*time.Second, "renewal interval of the gateway lease (must be < TTL/2)")
	f.DurationVar(&c.SessionLease, prefix+"gateway.session-lease", 40*time.Second, "node session lease (must be > gateway lease TTL)")
	f.DurationVar(&c.LivenessInterval, prefix+"gateway.liveness-interval", 10*time.Second, "interval of the batched session liveness write (must be < session lease/2)")
	f.DurationVar(&c.HeartbeatInterval, prefix+"gateway.heartbeat-interval", 5*time.Second, "heartbeat interval told to daemons in Welcome")
	f.IntVar(&c.MaxStreams, prefix+"gateway.max-streams", 5000, "maximum concurrent node streams")
	f.IntVar(&c.MaxPendingHellos, prefix+"gateway.max-pending-hellos", 64, "maximum Hellos admitted at once (past it a dial is pushed back); their transactions run on at most half of --db-max-conns, the rest wait up to 2 s, so a reconnect wave leaves connections to the group commit, dispatch and the liveness write")
	f.IntVar(&c.MaxPendingAuths, prefix+"gateway.max-pending-auths", 4, "maximum concurrent credential checks (one database read each; the only database work a Hello with a bad credential costs); keep it below --db-max-conns")
	f.Float64Var(&c.HelloRate, prefix+"gateway.hello-rate", 200, "handshake token bucket rate (Hellos per second)")
	f.IntVar(&c.HelloBurst, prefix+"gateway.hello-burst", 50, "handshake token bucket burst")
	f.IntVar(&c.MaxMessageBytes, prefix+"gateway.max-message-bytes", cmdkind.DefaultMessageBytes, "largest message accepted from a node")
	f.DurationVar(&c.DispatchPoll, prefix+"gateway.dispatch-poll", time.Second, "dispatch poll interval (NOTIFY wakes it earlier)")
	f.IntVar(&c.DispatchBatch, prefix+"gateway.dispatch-batch", 100, "commands taken per dispatch transaction; one call also asks at most this many sessions")
	f.DurationVar(&c.CommitSpacing, prefix+"gateway.commit-spacing", DefaultCommitSpacing, "least time between the starts of two group commits of what nodes report: results, acks and events that arrive meanwhile share the next transaction (the first after a quiet spell is written at once); 0 writes each batch as soon as the previous one is done")
	f.IntVar(&c.NodeWindow, prefix+"gateway.node-window", 32, "commands one node holds unanswered (sent, no result yet); more wait pending in the database")
	f.DurationVar(&c.OverloadLag, prefix+"gateway.overload-lag", DefaultOverloadLag, "report this gateway overloaded (the api then refuses new commands for its nodes, RESOURCE_EXHAUSTED) when commands wait this long for dispatch while their node has room, plus results for the group commit; 0 never reports it")
	f.DurationVar(&c.OverloadHold, prefix+"gateway.overload-hold", DefaultOverloadHold, "how long the lag must stay past --gateway.overload-lag before the gateway reports overload (a burst after a failover or outage is not refused)")
	f.DurationVar(&c.SpecPoll, prefix+"gateway.spec-poll", 2*time.Second, "node spec poll interval (NOTIFY pushes a changed spec earlier)")
	f.DurationVar(&c.DrainMaxDelay, prefix+"gateway.drain-max-delay", 60*time.Second, "upper bound of the random Drain delay sent on SIGTERM")
	f.DurationVar(&c.HelloTimeout, prefix+"gateway.hello-timeout", 10*time.Second, "close a stream whose Hello has not arrived within this long")
	f.StringVar(&c.HTTP2Server, prefix+"gateway.http2-server", HTTP2Lean, "HTTP/2 server of node streams: lean (internal/h2serve, least memory per session) or std (net/http)")
	f.DurationVar(&c.DrainGrace, prefix+"gateway.drain-grace", 5*time.Second, "extra wait after the drain delay before closing the remaining streams")
	f.StringVar(&c.MinDaemonVersion, prefix+"gateway.min-daemon-version", "", "refuse daemons older than this semantic version (e.g. v1.4.0), and those reporting none, with FAILED_PRECONDITION and a 5-10 min retry-after; empty accepts every version")
	f.StringVar(&c.RelayListenAddr, prefix+"gateway.relay-listen-addr", "", "address of the tunnel relay the api dials (h2c, shared token; keep it on a private network); empty relays no tunnels")
	f.StringVar(&c.RelayAdvertiseAddr, prefix+"gateway.relay-advertise-addr", "", "host:port api replicas dial to reach the relay (default: the address --gateway.relay-listen-addr bound)")
	f.StringVar(&c.RelayTokenFile, prefix+"gateway.relay-token-file", "", "file holding the relay's shared bearer token (the api's --api.relay-token-file), re-read on change; with --gateway.relay-listen-addr it or --gateway.relay-tls.client-ca-file is required")
	f.StringVar(&c.RelayTLS.Cert, prefix+"gateway.relay-tls.cert-file", "", "TLS certificate (PEM) of the tunnel relay, with --gateway.relay-tls.key-file; re-read on change")
	f.StringVar(&c.RelayTLS.Key, prefix+"gateway.relay-tls.key-file", "", "key (PEM) of --gateway.relay-tls.cert-file")
	f.StringVar(&c.RelayTLS.ClientCA, prefix+"gateway.relay-tls.client-ca-file", "", "CA bundle (PEM): the api must present a client certificate it signed naming --gateway.relay-tls.client-name (mTLS); re-read on change")
	f.StringVar(&c.RelayClientName, prefix+"gateway.relay-tls.client-name", "leasehold-api", "name (DNS SAN, else CommonName) the api's relay client certificate must carry")
	f.IntVar(&c.MaxTunnelsPerNode, prefix+"gateway.max-tunnels-per-node", 4, "tunnels open at once to one node")
	f.IntVar(&c.MaxTunnels, prefix+"gateway.max-tunnels", 256, "tunnels open at once through this gateway")
	f.DurationVar(&c.TunnelIdleTimeout, prefix+"gateway.tunnel-idle-timeout", 5*time.Minute, "end a tunnel that carried no byte for this long")
	f.DurationVar(&c.TunnelAttachTimeout, prefix+"gateway.tunnel-attach-timeout", 15*time.Second, "how long the daemon may take to connect a tunnel's target and attach")
	f.Int64Var(&c.OutputCap, prefix+"gateway.output-cap", 1<<20, "bytes of live output stored per command; past it a truncation marker is stored and the rest dropped")
}

// Listeners lists the gateway's listeners for lifecycle.CheckPlaintext:
// node streams and the tunnel relay.
func (c *Config) Listeners() []lifecycle.Listener {
	return []lifecycle.Listener{
		{Flag: "listen-addr", Addr: c.ListenAddr, TLS: c.TLSCert != "", TLSFlag: "tls-cert"},
		{Flag: "gateway.relay-listen-addr", Addr: c.RelayListenAddr, TLS: c.RelayTLS.Cert != "", TLSFlag: "gateway.relay-tls.cert-file"},
	}
}

// DefaultCommitSpacing is --gateway.commit-spacing's default: a group
// commit at most every 10 ms, so at a moderate rate reports share
// transactions (fewer commits, each flushing the WAL) for a few
// milliseconds' wait (docs/decisions.md, "Group commits spaced").
const DefaultCommitSpacing = 10 * time.Millisecond

// Values of --gateway.http2-server.
const (
	HTTP2Lean = "lean"
	HTTP2Std  = "std"
)

// Defaults returns the configuration RegisterFlags would produce.
func Defaults() Config {
	var c Config
	c.RegisterFlags("", flag.NewFlagSet("defaults", flag.ContinueOnError))
	return c
}

// Validate refuses bad values and broken orderings, naming both values.
func (c *Config) Validate() error {
	var errs []error
	if c.ListenAddr == "" {
		errs = append(errs, errors.New("--listen-addr is required"))
	}
	if (c.TLSCert == "") != (c.TLSKey == "") {
		errs = append(errs, fmt.Errorf("--tls-cert %q and --tls-key %q must be given together", c.TLSCert, c.TLSKey))
	}
	if c.TLSReloadInterval < 0 || c.TLSReloadInterval > time.Hour {
		errs = append(errs, fmt.Errorf("--tls-reload-interval %s must be in [0, 1h] (0: 10s)", c.TLSReloadInterval))
	}
	if c.TLSClientCA != "" && c.TLSCert == "" {
		errs = append(errs, fmt.Errorf("--tls-client-ca %q needs --tls-cert and --tls-key", c.TLSClientCA))
	}
	positive := map[string]time.Duration{
		"--gateway.lease-ttl": c.LeaseTTL, "--gateway.lease-renew": c.LeaseRenew,
		"--gateway.session-lease": c.SessionLease, "--gateway.liveness-interval": c.LivenessInterval,
		"--gateway.heartbeat-interval": c.HeartbeatInterval, "--gateway.dispatch-poll": c.DispatchPoll,
		"--gateway.spec-poll": c.SpecPoll,
	}
	for _, name := range []string{"--gateway.lease-ttl", "--gateway.lease-renew", "--gateway.session-lease",
		"--gateway.liveness-interval", "--gateway.heartbeat-interval", "--gateway.dispatch-poll", "--gateway.spec-poll"} {
		if positive[name] <= 0 {
			errs = append(errs, fmt.Errorf("%s %s must be positive", name, positive[name]))
		}
	}
	if c.LeaseTTL > 0 && c.LeaseTTL%time.Millisecond != 0 {
		errs = append(errs, fmt.Errorf("--gateway.lease-ttl %s must be whole milliseconds", c.LeaseTTL))
	}
	if c.LeaseRenew > 0 && c.LeaseTTL > 0 && c.LeaseRenew >= c.LeaseTTL/2 {
		errs = append(errs, fmt.Errorf("--gateway.lease-renew %s must be less than half of --gateway.lease-ttl %s", c.LeaseRenew, c.LeaseTTL))
	}
	if c.SessionLease > 0 && c.SessionLease <= c.LeaseTTL {
		errs = append(errs, fmt.Errorf("--gateway.session-lease %s must be greater than --gateway.lease-ttl %s", c.SessionLease, c.LeaseTTL))
	}
	if c.LivenessInterval > 0 && c.LivenessInterval >= c.SessionLease/2 {
		errs = append(errs, fmt.Errorf("--gateway.liveness-interval %s must be less than half of --gateway.session-lease %s", c.LivenessInterval, c.SessionLease))
	}
	if c.HeartbeatInterval > 0 && 3*c.HeartbeatInterval >= c.SessionLease {
		errs = append(errs, fmt.Errorf("--gateway.heartbeat-interval %s times 3 must be less than --gateway.session-lease %s", c.HeartbeatInterval, c.SessionLease))
	}
	if c.OverloadLag < 0 || c.OverloadLag > time.Minute {
		errs = append(errs, fmt.Errorf("--gateway.overload-lag %s must be in [0, 1m] (0: never report overload)", c.OverloadLag))
	}
	if c.OverloadHold < 0 || c.OverloadHold > time.Minute {
		errs = append(errs, fmt.Errorf("--gateway.overload-hold %s must be in [0, 1m]", c.OverloadHold))
	}
	if c.MinDaemonVersion != "" && buildinfo.Release(c.MinDaemonVersion) == "" {
		errs = append(errs, fmt.Errorf("--gateway.min-daemon-version %q is not a semantic version (vMAJOR[.MINOR[.PATCH]])", c.MinDaemonVersion))
	}
	if c.MaxStreams < 1 {
		errs = append(errs, fmt.Errorf("--gateway.max-streams %d must be at least 1", c.MaxStreams))
	}
	if c.MaxPendingHellos < 1 || c.MaxPendingHellos > c.MaxStreams {
		errs = append(errs, fmt.Errorf("--gateway.max-pending-hellos %d must be in 1..--gateway.max-streams %d", c.MaxPendingHellos, c.MaxStreams))
	}
	if c.MaxPendingAuths < 1 || c.MaxPendingAuths > c.MaxPendingHellos {
		errs = append(errs, fmt.Errorf("--gateway.max-pending-auths %d must be in 1..--gateway.max-pending-hellos %d", c.MaxPendingAuths, c.MaxPendingHellos))
	}
	if c.HelloRate <= 0 || c.HelloBurst < 1 {
		errs = append(errs, fmt.Errorf("--gateway.hello-rate %g must be positive and --gateway.hello-burst %d at least 1", c.HelloRate, c.HelloBurst))
	}
	if c.MaxMessageBytes < 1024 || c.MaxMessageBytes > 64<<20 {
		errs = append(errs, fmt.Errorf("--gateway.max-message-bytes %d must be in 1024..%d", c.MaxMessageBytes, 64<<20))
	}
	if c.CommitSpacing < 0 || c.CommitSpacing > time.Second {
		errs = append(errs, fmt.Errorf("--gateway.commit-spacing %s must be in [0, 1s]", c.CommitSpacing))
	}
	if c.DispatchBatch < 1 || c.DispatchBatch > 10000 {
		errs = append(errs, fmt.Errorf("--gateway.dispatch-batch %d must be in 1..10000", c.DispatchBatch))
	}
	if c.NodeWindow < 1 || c.NodeWindow > maxQueued/2 {
		errs = append(errs, fmt.Errorf("--gateway.node-window %d must be in 1..%d", c.NodeWindow, maxQueued/2))
	}
	if c.HelloTimeout < 10*time.Millisecond {
		errs = append(errs, fmt.Errorf("--gateway.hello-timeout %s must be at least 10ms", c.HelloTimeout))
	}
	if c.DrainMaxDelay < 0 || c.DrainGrace < 0 {
		errs = append(errs, fmt.Errorf("--gateway.drain-max-delay %s and --gateway.drain-grace %s must not be negative", c.DrainMaxDelay, c.DrainGrace))
	}
	if c.OutputCap < 1024 || c.OutputCap > 1<<30 {
		errs = append(errs, fmt.Errorf("--gateway.output-cap %d must be in 1024..%d", c.OutputCap, 1<<30))
	}
	if c.RelayListenAddr != "" && c.RelayTokenFile == "" && c.RelayTLS.ClientCA == "" {
		errs = append(errs, fmt.Errorf("--gateway.relay-listen-addr %q needs --gateway.relay-token-file or --gateway.relay-tls.client-ca-file (or both) to authenticate the api", c.RelayListenAddr))
	}
	if (c.RelayTLS.Cert == "") != (c.RelayTLS.Key == "") {
		errs = append(errs, errors.New("--gateway.relay-tls.cert-file and --gateway.relay-tls.key-file go together"))
	}
	if c.RelayTLS.ClientCA != "" && c.RelayTLS.Cert == "" {
		errs = append(errs, errors.New("--gateway.relay-tls.client-ca-file needs --gateway.relay-tls.cert-file and --gateway.relay-tls.key-file (client certificates are checked in a TLS handshake)"))
	}
	if c.RelayTLS.ClientCA != "" && c.RelayClientName == "" {
		errs = append(errs, errors.New("--gateway.relay-tls.client-name must not be empty with --gateway.relay-tls.client-ca-file"))
	}
	if c.MaxTunnelsPerNode < 1 || c.MaxTunnels < c.MaxTunnelsPerNode {
		errs = append(errs, fmt.Errorf("--gateway.max-tunnels-per-node %d must be at least 1 and at most --gateway.max-tunnels %d", c.MaxTunnelsPerNode, c.MaxTunnels))
	}
	// A node's tunnels share its session's HTTP/2 connection: beside the
	// session stream they must fit in its stream limit (or a Tunnel stream
	// opens a new connection, which the balancer may send to another
	// gateway), and their stalled receive windows must leave the session
	// connection window to spare.
	if c.MaxTunnelsPerNode > maxConnStreams-1 {
		errs = append(errs, fmt.Errorf("--gateway.max-tunnels-per-node %d must be at most %d (the streams of one node connection, less its session)", c.MaxTunnelsPerNode, maxConnStreams-1))
	}
	if c.TunnelIdleTimeout < time.Second || c.TunnelAttachTimeout < 100*time.Millisecond {
		errs = append(errs, fmt.Errorf("--gateway.tunnel-idle-timeout %s must be at least 1s and --gateway.tunnel-attach-timeout %s at least 100ms", c.TunnelIdleTimeout, c.TunnelAttachTimeout))
	}
	if c.HTTP2Server != HTTP2Lean && c.HTTP2Server != HTTP2Std {
		errs = append(errs, fmt.Errorf("--gateway.http2-server %q must be %q or %q", c.HTTP2Server, HTTP2Lean, HTTP2Std))
	}
	return errors.Join(errs...)
}
