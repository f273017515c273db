package agent

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/reload"
	"github.com/leasehold/leasehold/services/site-agent/internal/imagecache"
	"github.com/leasehold/leasehold/services/site-agent/internal/pxe"
	"github.com/leasehold/leasehold/services/site-agent/internal/redfish"
	"github.com/leasehold/leasehold/services/site-agent/internal/tftp"
)

// DefaultJournal is the command journal's file unless --journal says
// otherwise: under the unit's StateDirectory (/var/lib/leasehold), in a
// directory of its own that the agent creates 0700.
const DefaultJournal = "/var/lib/leasehold/site-agent/journal"

// Config is the site agent's configuration (docs/design.md#site-agents and #timings).
type Config struct {
	// GatewayURL is the gateway balancer's base URL (http:// for h2c).
	GatewayURL string
	// NodeID, Credential (or CredentialFile) and SiteID identify the agent.
	NodeID, Credential, CredentialFile, SiteID string
	// BackoffMax bounds redial back-off (60 s).
	BackoffMax time.Duration
	// TLS names the CA bundle the gateway's certificate must chain to and
	// the client certificate for a gateway that requires mTLS; every file
	// is re-read on change.
	TLS reload.ClientTLSFiles
	// Journal is the file of the durable command journal: every BMC
	// command is recorded there as started before it runs and with its
	// result after, so none runs twice across a restart
	// (docs/site-agent.md, "The command journal").
	Journal string

	// SelfFence is how long a boot grant is trusted (10 s); LeaseTTL and
	// PromoteAfter are the control plane's boot lease TTL and promotion
	// delay this agent expects (15 s, 15 s). self-fence < TTL <= promotion
	// is checked at start and again for every grant.
	SelfFence, LeaseTTL, PromoteAfter time.Duration

	// DHCP is the proxy DHCP responder; its ScriptBaseURL defaults to
	// BootBaseURL.
	DHCP pxe.Config
	// BootListenAddr serves iPXE scripts and images; BootBaseURL is how
	// machines reach it (default http://<dhcp.server-ip>:<port>).
	BootListenAddr, BootBaseURL string
	// HostsFile maps MACs to boot profiles.
	HostsFile string
	// TFTP serves the iPXE binaries to firmware PXE (only while active);
	// the same directory is served over HTTP at /tftp/ for UEFI HTTP boot.
	TFTP tftp.Config

	// Cache is the image cache.
	Cache imagecache.Config
	// BMC is the Redfish client.
	BMC redfish.Config
}

// RegisterFlags registers the flags on f, each name under prefix, with their defaults.
func (c *Config) RegisterFlags(prefix string, f *flag.FlagSet) {
	f.StringVar(&c.GatewayURL, prefix+"gateway-url", "http://127.0.0.1:9443", "gateway (balancer) base URL: http:// for h2c, https:// for TLS")
	f.StringVar(&c.NodeID, prefix+"node-id", "", "this agent's node id (registered with kind site_agent)")
	f.StringVar(&c.Credential, prefix+"node-credential", "", "node credential (prefer LEASEHOLD_NODE_CREDENTIAL or --node-credential-file)")
	f.StringVar(&c.CredentialFile, prefix+"node-credential-file", "", "file holding the node credential")
	f.StringVar(&c.SiteID, prefix+"site-id", "", "the bare-metal site this agent serves")
	f.DurationVar(&c.BackoffMax, prefix+"redial-backoff-max", 60*time.Second, "upper bound of the redial back-off")
	c.TLS.RegisterFlags(prefix, f)
	f.StringVar(&c.Journal, prefix+"journal", DefaultJournal, "file of the command journal, so no BMC command runs twice across a restart (its directory is created 0700; one agent per file)")
	f.DurationVar(&c.SelfFence, prefix+"boot.self-fence", 10*time.Second, "stop answering DHCP/iPXE this long after the last boot grant; must be < --boot.lease-ttl")
	f.DurationVar(&c.LeaseTTL, prefix+"boot.lease-ttl", 15*time.Second, "the site:<id>:boot lease TTL the control plane uses (worker --sites.boot-lease-ttl)")
	f.DurationVar(&c.PromoteAfter, prefix+"boot.promote-after", 15*time.Second, "the promotion delay the control plane uses (worker --sites.promote-after); must be >= --boot.lease-ttl")
	f.StringVar(&c.DHCP.ListenAddr, prefix+"dhcp.listen-addr", "0.0.0.0:67", "UDP address of the proxy DHCP responder")
	f.StringVar(&c.DHCP.PXEListenAddr, prefix+"dhcp.pxe-listen-addr", "0.0.0.0:4011", "UDP address of the PXE boot server port, where clients send their ProxyDHCP REQUEST (empty: off)")
	f.StringVar(&c.DHCP.Interface, prefix+"dhcp.interface", "", "bind the DHCP socket to this interface")
	f.Func(prefix+"dhcp.server-ip", "this agent's IPv4 address on the provisioning network (server identifier, next-server)", func(s string) error {
		ip := net.ParseIP(s)
		if ip == nil || ip.To4() == nil {
			return fmt.Errorf("%q is not an IPv4 address", s)
		}
		c.DHCP.ServerIP = ip.To4()
		return nil
	})
	f.StringVar(&c.DHCP.TFTPServer, prefix+"dhcp.tftp-server", "", "TFTP server for firmware PXE boot files (default: --dhcp.server-ip)")
	f.StringVar(&c.DHCP.BootFileBIOS, prefix+"dhcp.boot-file-bios", "undionly.kpxe", "iPXE binary for BIOS PXE clients")
	f.StringVar(&c.DHCP.BootFileEFI, prefix+"dhcp.boot-file-efi", "ipxe.efi", "iPXE binary for UEFI PXE clients")
	f.StringVar(&c.BootListenAddr, prefix+"boot.listen-addr", "0.0.0.0:8080", "address serving iPXE scripts (/boot/<mac>.ipxe) and images (/images/sha256/<digest>)")
	f.StringVar(&c.BootBaseURL, prefix+"boot.base-url", "", "URL machines use to reach --boot.listen-addr (default http://<dhcp.server-ip>:<port>)")
	f.StringVar(&c.HostsFile, prefix+"boot.hosts-file", "", `JSON {"default":{profile},"hosts":{"<mac>":{"kernel":"<sha256>","initrd":"<sha256>","cmdline":"…"}}}`)
	f.StringVar(&c.TFTP.ListenAddr, prefix+"tftp.listen-addr", "0.0.0.0:69", "UDP address of the TFTP server (firmware PXE downloads iPXE from it)")
	f.StringVar(&c.TFTP.Root, prefix+"tftp.root", "/var/lib/leasehold/tftp", "directory served read-only over TFTP and at /tftp/ over HTTP; put Debian's ipxe package's undionly.kpxe and ipxe.efi here")
	f.IntVar(&c.TFTP.MaxTransfers, prefix+"tftp.max-transfers", 64, "concurrent TFTP transfers; more are refused with 'server busy'")
	f.IntVar(&c.TFTP.MaxBlockSize, prefix+"tftp.max-blksize", 1468, "largest blksize granted (RFC 2348); 1468 fills a 1500-byte frame")
	f.DurationVar(&c.TFTP.Timeout, prefix+"tftp.timeout", time.Second, "retransmission timeout unless the client asks for one (RFC 2349)")
	f.IntVar(&c.TFTP.Retries, prefix+"tftp.retries", 5, "sends of a block before a transfer is abandoned")
	f.StringVar(&c.Cache.Dir, prefix+"cache.dir", "/var/lib/leasehold/images", "image cache directory")
	f.StringVar(&c.Cache.Origin, prefix+"cache.origin", "", "origin base URL; an image is fetched from <origin>/<sha256>")
	f.Int64Var(&c.Cache.MaxBytes, prefix+"cache.max-bytes", 8<<30, "largest image accepted")
	f.Int64Var(&c.Cache.Budget, prefix+"cache.budget-bytes", 64<<30, "all images together; the least recently served are evicted beyond it")
	f.IntVar(&c.Cache.Attempts, prefix+"cache.fetch-attempts", 3, "origin requests one download may take, resuming with Range after a broken connection")
	f.DurationVar(&c.Cache.FetchTimeout, prefix+"cache.fetch-timeout", 10*time.Minute, "bound of one image download")
	f.StringVar(&c.BMC.CredentialsFile, prefix+"bmc.credentials-file", "", `JSON {"<ref>":{"username":…,"password":…}} of BMC accounts named by command payloads`)
	f.BoolVar(&c.BMC.InsecureSkipVerify, prefix+"bmc.insecure-skip-verify", false, "accept BMC TLS certificates without verification")
	f.DurationVar(&c.BMC.Timeout, prefix+"bmc.timeout", 30*time.Second, "bound of one Redfish call")
}

// Resolve fills derived values (credential from file, base URLs) and
// validates; call it once after parsing.
func (c *Config) Resolve() error {
	if c.Credential == "" && c.CredentialFile != "" {
		b, err := os.ReadFile(c.CredentialFile)
		if err != nil {
			return fmt.Errorf("read --node-credential-file: %w", err)
		}
		c.Credential = strings.TrimSpace(string(b))
	}
	if c.BootBaseURL == "" && c.DHCP.ServerIP != nil {
		_, port, err := net.SplitHostPort(c.BootListenAddr)
		if err == nil {
			c.BootBaseURL = "http://" + net.JoinHostPort(c.DHCP.ServerIP.String(), port)
		}
	}
	c.DHCP.ScriptBaseURL = c.BootBaseURL
	return c.Validate()
}

// Validate refuses bad values and broken orderings, naming both values.
func (c *Config) Validate() error {
	var errs []error
	if !strings.HasPrefix(c.GatewayURL, "http://") && !strings.HasPrefix(c.GatewayURL, "https://") {
		errs = append(errs, fmt.Errorf("--gateway-url %q must start with http:// or https://", c.GatewayURL))
	}
	if err := c.TLS.Validate("", c.GatewayURL); err != nil {
		errs = append(errs, err)
	}
	if err := nodeauth.ValidateNodeID(c.NodeID); err != nil {
		errs = append(errs, fmt.Errorf("--node-id: %w", err))
	}
	if c.Credential == "" {
		errs = append(errs, errors.New("a node credential is required (LEASEHOLD_NODE_CREDENTIAL or --node-credential-file)"))
	}
	if c.SiteID == "" || len(c.SiteID) > 194 {
		errs = append(errs, fmt.Errorf("--site-id %q must be 1..194 bytes", c.SiteID))
	}
	if c.Journal == "" || !filepath.IsAbs(c.Journal) {
		errs = append(errs, fmt.Errorf("--journal %q must be an absolute path", c.Journal))
	}
	if c.BackoffMax < 100*time.Millisecond {
		errs = append(errs, fmt.Errorf("--redial-backoff-max %s must be >= 100ms", c.BackoffMax))
	}
	if c.SelfFence <= 0 || c.SelfFence >= c.LeaseTTL {
		errs = append(errs, fmt.Errorf("--boot.self-fence %s must be positive and less than --boot.lease-ttl %s (self-fence < TTL)", c.SelfFence, c.LeaseTTL))
	}
	if c.LeaseTTL > c.PromoteAfter {
		errs = append(errs, fmt.Errorf("--boot.lease-ttl %s must be <= --boot.promote-after %s (TTL <= promotion)", c.LeaseTTL, c.PromoteAfter))
	}
	if err := c.DHCP.Validate(); err != nil {
		errs = append(errs, err)
	}
	if _, _, err := net.SplitHostPort(c.BootListenAddr); err != nil {
		errs = append(errs, fmt.Errorf("--boot.listen-addr %q: %w", c.BootListenAddr, err))
	}
	if err := c.TFTP.Validate(); err != nil {
		errs = append(errs, err)
	}
	if c.Cache.Dir == "" {
		errs = append(errs, errors.New("--cache.dir is required"))
	}
	if c.Cache.Origin != "" && !strings.HasPrefix(c.Cache.Origin, "http://") && !strings.HasPrefix(c.Cache.Origin, "https://") {
		errs = append(errs, fmt.Errorf("--cache.origin %q must be an http(s) URL", c.Cache.Origin))
	}
	if c.Cache.MaxBytes < 1 {
		errs = append(errs, fmt.Errorf("--cache.max-bytes %d must be positive", c.Cache.MaxBytes))
	}
	if c.Cache.Budget < c.Cache.MaxBytes {
		errs = append(errs, fmt.Errorf("--cache.budget-bytes %d must be >= --cache.max-bytes %d (one image must fit)", c.Cache.Budget, c.Cache.MaxBytes))
	}
	if c.Cache.Attempts < 1 {
		errs = append(errs, fmt.Errorf("--cache.fetch-attempts %d must be positive", c.Cache.Attempts))
	}
	return errors.Join(errs...)
}
