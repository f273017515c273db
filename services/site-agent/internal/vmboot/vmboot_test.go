package vmboot

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/fleettest"
	"github.com/leasehold/leasehold/pkg/nodereg"
	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// What the test needs from Debian's packages (qemu-system-x86, ovmf, ipxe,
// dnsmasq-base); .ci/run installs them.
var (
	ovmfCode = "/usr/share/OVMF/OVMF_CODE_4M.fd"
	ovmfVars = "/usr/share/OVMF/OVMF_VARS_4M.fd"
	ipxeEFI  = "/usr/lib/ipxe/ipxe.efi"
	ipxeBIOS = "/usr/lib/ipxe/undionly.kpxe"
	snpEFI   = "/usr/lib/ipxe/snponly.efi"
	seabios  = "/usr/share/seabios/bios-256k.bin"
	pxeROM   = "/usr/lib/ipxe/qemu/pxe-e1000.rom" // the e1000's option ROM for SeaBIOS (iPXE as the NIC's PXE)
)

// The site's network, inside the test's namespaces.
const (
	bridgeIP  = "10.77.0.1"
	agentAIP  = "10.77.0.2"
	agentBIP  = "10.77.0.3"
	bridgeIP6 = "fd77::1"
	innerEnv  = "LEASEHOLD_VMBOOT_NETNS" // set in the re-executed test: "<site> <agent-a> <agent-b>"
)

// runLimit bounds the whole inner run (two UEFI boots and a BIOS boot
// under TCG on a busy 2-core machine).
const runLimit = 12 * time.Minute

// TestVMsBootThroughTheActiveAgentThenThePromotedStandby boots virtual
// machines with firmware nobody here wrote. In namespaces it creates: a
// bridge with dnsmasq as the site's ordinary DHCP server (addresses only),
// two real site agent processes in namespaces of their own (each behind a
// veth on the bridge), and QEMU (TCG) on a tap. The first VM (OVMF) boots
// through the active agent: proxy DHCP offer, TFTP of ipxe.efi, iPXE's own
// DHCP, its script over HTTP, and a kernel and initrd from the image cache;
// the standby sees the same broadcasts and answers none. The active agent
// is killed; once the standby is promoted a second VM completes the same
// chain through it, and a SeaBIOS VM boots undionly.kpxe the legacy way.
// Both agents' roles are sampled throughout: never both active.
//
// The test re-executes itself inside the site namespace so that PostgreSQL,
// the gateway and the worker run there too.
func TestVMsBootThroughTheActiveAgentThenThePromotedStandby(t *testing.T) {
	if testing.Short() {
		t.Skip("boots virtual machines under TCG: minutes (not under -short)")
	}
	if ns := os.Getenv(innerEnv); ns != "" {
		inner(t, strings.Fields(ns))
		return
	}
	if os.Getenv(pgtest.EnvPgBouncer) != "" {
		t.Skip("the boot chain does not involve the pooler: run once, without PgBouncer")
	}
	requireTools(t)
	site, a, b := namespaces(t)
	ctx, cancel := context.WithTimeout(context.Background(), runLimit+time.Minute)
	defer cancel()
	self, err := os.Executable()
	require.NoError(t, err)
	cmd := exec.CommandContext(ctx, "ip", "netns", "exec", site, self, "-test.run", "^"+t.Name()+"$", "-test.v",
		"-test.count", "1", "-test.timeout", runLimit.String())
	cmd.Env = append(os.Environ(), innerEnv+"="+site+" "+a+" "+b)
	out, err := cmd.CombinedOutput()
	t.Logf("inner run (in namespace %s):\n%s", site, out)
	require.NoError(t, err, "the boot test inside the namespaces failed")
}

// requireTools skips (outside CI) or fails (in CI) when a package is missing.
func requireTools(t *testing.T) {
	t.Helper()
	var missing []string
	for _, bin := range []string{"ip", "dnsmasq", "qemu-system-x86_64"} {
		if _, err := exec.LookPath(bin); err != nil {
			missing = append(missing, bin)
		}
	}
	for _, f := range []string{ovmfCode, ovmfVars, ipxeEFI, ipxeBIOS, snpEFI} {
		if _, err := os.Stat(f); err != nil {
			missing = append(missing, f)
		}
	}
	if len(missing) == 0 {
		return
	}
	msg := fmt.Sprintf("missing %s (Debian packages qemu-system-x86, ovmf, ipxe, dnsmasq-base; .ci/run installs them)", strings.Join(missing, ", "))
	if os.Getenv("CI") != "" {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

// sh runs a command and returns its combined output and error.
func sh(args ...string) (string, error) {
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

func must(t *testing.T, args ...string) {
	t.Helper()
	if out, err := sh(args...); err != nil {
		t.Fatalf("%s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// namespaces creates the site namespace (bridge, two taps) and one per
// agent (a veth onto the bridge), and removes them, and every process still
// in them, when the test ends. It skips when the kernel refuses namespaces
// or tap devices.
func namespaces(t *testing.T) (site, a, b string) {
	t.Helper()
	prefix := fmt.Sprintf("lhvm%d", os.Getpid())
	site, a, b = prefix+"-site", prefix+"-a", prefix+"-b"
	for _, ns := range []string{site, a, b} {
		if out, err := sh("ip", "netns", "add", ns); err != nil {
			t.Skipf("the kernel refuses network namespaces here: ip netns add: %v: %s", err, out)
		}
		t.Cleanup(func() {
			if pids, err := sh("ip", "netns", "pids", ns); err == nil {
				for _, p := range strings.Fields(pids) {
					if pid, err := strconv.Atoi(p); err == nil {
						_ = syscall.Kill(pid, syscall.SIGKILL)
					}
				}
			}
			if out, err := sh("ip", "netns", "del", ns); err != nil {
				t.Errorf("remove namespace %s: %v: %s", ns, err, out)
			}
		})
		must(t, "ip", "-n", ns, "link", "set", "lo", "up")
	}
	must(t, "ip", "-n", site, "link", "add", "br0", "type", "bridge")
	must(t, "ip", "-n", site, "addr", "add", bridgeIP+"/24", "dev", "br0")
	must(t, "ip", "-n", site, "addr", "add", bridgeIP6+"/64", "dev", "br0", "nodad")
	must(t, "ip", "-n", site, "link", "set", "br0", "up")
	for i, tap := range []string{"tap0", "tap1", "tap2"} {
		if out, err := sh("ip", "-n", site, "tuntap", "add", "dev", tap, "mode", "tap"); err != nil {
			t.Skipf("the kernel refuses tap devices here: ip tuntap add: %v: %s", err, out)
		}
		must(t, "ip", "-n", site, "link", "set", tap, "master", "br0", "up")
		_ = i
	}
	for _, ag := range []struct{ ns, veth, ip string }{{a, "va", agentAIP}, {b, "vb", agentBIP}} {
		must(t, "ip", "-n", site, "link", "add", ag.veth, "type", "veth", "peer", "name", "eth0", "netns", ag.ns)
		must(t, "ip", "-n", site, "link", "set", ag.veth, "master", "br0", "up")
		must(t, "ip", "-n", ag.ns, "addr", "add", ag.ip+"/24", "dev", "eth0")
		must(t, "ip", "-n", ag.ns, "link", "set", "eth0", "up")
	}
	return site, a, b
}

// agentProc is one site agent process and what the test knows about it.
type agentProc struct {
	*proctest.Proc
	id, ip string
}

// logLine is one JSON log line of an agent.
type logLine struct {
	at     time.Time
	msg    string
	fields map[string]any
}

func (p *agentProc) lines() []logLine {
	var out []logLine
	sc := bufio.NewScanner(strings.NewReader(p.Logs()))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var m map[string]any
		if json.Unmarshal(sc.Bytes(), &m) != nil {
			continue
		}
		at, _ := time.Parse(time.RFC3339Nano, fmt.Sprint(m["time"]))
		out = append(out, logLine{at: at, msg: fmt.Sprint(m["msg"]), fields: m})
	}
	return out
}

// find returns the first line at or after since with msg whose fields
// include want.
func (p *agentProc) find(since time.Time, msg string, want map[string]string) (logLine, bool) {
	for _, l := range p.lines() {
		if l.at.Before(since) || l.msg != msg {
			continue
		}
		ok := true
		for k, v := range want {
			if fmt.Sprint(l.fields[k]) != v {
				ok = false
			}
		}
		if ok {
			return l, true
		}
	}
	return logLine{}, false
}

var roleRE = regexp.MustCompile(`(?m)^leasehold_role\{component="site-boot"\} (\d+)`)

// role reads the agent's site-boot role from /metrics: 0 standby, 1
// active, 2 fenced, -1 unreachable.
func (p *agentProc) role() int {
	code, body, err := p.Get("/metrics", "")
	if err != nil || code != http.StatusOK {
		return -1
	}
	m := roleRE.FindStringSubmatch(body)
	if m == nil {
		return -1
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

func (p *agentProc) metric(name, label string) float64 {
	_, body, err := p.Get("/metrics", "")
	if err != nil {
		return -1
	}
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + `\{outcome="` + label + `"\} (\S+)`)
	m := re.FindStringSubmatch(body)
	if m == nil {
		return 0
	}
	v, _ := strconv.ParseFloat(m[1], 64)
	return v
}

// origin is the image origin the agents' caches fetch from.
type origin struct {
	files map[string][]byte
	mu    sync.Mutex
	hits  map[string]int
}

func (o *origin) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	d := strings.TrimPrefix(r.URL.Path, "/")
	b, ok := o.files[d]
	o.mu.Lock()
	o.hits[d]++
	o.mu.Unlock()
	if !ok {
		http.NotFound(w, r)
		return
	}
	http.ServeContent(w, r, "", time.Time{}, strings.NewReader(string(b)))
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

func digest(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from) // follows /usr/lib/ipxe/ipxe.efi -> /boot/ipxe.efi
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(to, b, 0o644))
}

// inner runs inside the site namespace.
func inner(t *testing.T, ns []string) {
	site, nsA, nsB := ns[0], ns[1], ns[2]
	_ = site
	ctx := context.Background()
	db := pgtest.NewDB(t)
	port, err := pglocal.FreePort()
	require.NoError(t, err)
	gwListen := net.JoinHostPort(bridgeIP, strconv.Itoa(port))
	// A gateway lease of 8 s, not FastGateway's 2 s: TCG saturates a core.
	fleettest.StartGateway(t, db.URL, "gw_vm", append(append([]string{}, fleettest.FastGateway...),
		"--gateway.spec-poll", "200ms", "--gateway.lease-ttl", "8s", "--gateway.lease-renew", "2s",
		"--gateway.session-lease", "12s", "--listen-addr", gwListen,
		// The bridge address is not loopback, but the network is the
		// namespaces this test made: plaintext is allowed on purpose.
		"--insecure-plaintext")...)
	fleettest.StartService(t, "worker", db.URL, "w_vm", append(append([]string{}, fleettest.FastCoord...),
		"--sites.boot-lease-ttl", "3s", "--sites.promote-after", "3s", "--sites.renew-interval", "500ms",
		"--sites.scan-interval", "500ms")...)

	// Images: the "kernel" is an EFI binary (iPXE's snponly.efi) so that
	// iPXE accepts and boots it; the initrd is random bytes.
	kernel, err := os.ReadFile(snpEFI)
	require.NoError(t, err)
	initrd := make([]byte, 256<<10)
	_, _ = rand.Read(initrd)
	o := &origin{files: map[string][]byte{digest(kernel): kernel, digest(initrd): initrd}, hits: map[string]int{}}
	oln, err := net.Listen("tcp", net.JoinHostPort(bridgeIP, "0"))
	require.NoError(t, err)
	osrv := &http.Server{Handler: o, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = osrv.Serve(oln) }()
	t.Cleanup(func() { _ = osrv.Close() })

	dir := t.TempDir()
	tftpRoot := filepath.Join(dir, "tftp")
	require.NoError(t, os.Mkdir(tftpRoot, 0o755))
	copyFile(t, ipxeEFI, filepath.Join(tftpRoot, "ipxe.efi"))
	copyFile(t, ipxeBIOS, filepath.Join(tftpRoot, "undionly.kpxe"))
	hosts := filepath.Join(dir, "hosts.json")
	hb, _ := json.Marshal(map[string]any{"default": map[string]string{"kernel": digest(kernel), "initrd": digest(initrd), "cmdline": "console=ttyS0"}})
	require.NoError(t, os.WriteFile(hosts, hb, 0o644))

	bin := fleettest.Binary(t, "site-agent")
	agents := map[string]*agentProc{}
	for _, ag := range []struct{ id, ns, ip string }{{"agent-a", nsA, agentAIP}, {"agent-b", nsB, agentBIP}} {
		cred, err := nodereg.Register(ctx, db.Pool, nodereg.Node{ID: ag.id, Kind: "site_agent", SiteID: "site1"})
		require.NoError(t, err)
		cache := filepath.Join(dir, "cache-"+ag.id)
		p := proctest.Start(t, ag.id, "ip", []string{"LEASEHOLD_NODE_CREDENTIAL=" + cred}, "netns", "exec", ag.ns, bin,
			"--gateway-url", "http://"+gwListen, "--node-id", ag.id, "--site-id", "site1", "--redial-backoff-max", "1s",
			"--boot.self-fence", "2s", "--boot.lease-ttl", "3s", "--boot.promote-after", "3s",
			"--dhcp.server-ip", ag.ip, "--dhcp.interface", "eth0",
			"--tftp.root", tftpRoot, "--boot.listen-addr", "0.0.0.0:8080", "--boot.hosts-file", hosts,
			"--cache.dir", cache, "--cache.origin", "http://"+oln.Addr().String(), "--cache.max-bytes", "8388608",
			"--cache.budget-bytes", "16777216", "--journal", filepath.Join(dir, "journal-"+ag.id),
			"--http-addr", net.JoinHostPort(ag.ip, "9105"), "--log-format", "json", "--log-level", "debug")
		p.WaitReady(60 * time.Second)
		agents[ag.id] = &agentProc{Proc: p, id: ag.id, ip: ag.ip}
	}
	var active, standby *agentProc
	require.Eventually(t, func() bool {
		ra, rb := agents["agent-a"].role(), agents["agent-b"].role()
		switch {
		case ra == 1 && rb == 0:
			active, standby = agents["agent-a"], agents["agent-b"]
		case rb == 1 && ra == 0:
			active, standby = agents["agent-b"], agents["agent-a"]
		default:
			return false
		}
		return true
	}, 60*time.Second, 100*time.Millisecond, "one agent active, the other standby")
	t.Logf("active %s (%s), standby %s (%s)", active.id, active.ip, standby.id, standby.ip)

	// Sample both roles until the end: never both active.
	var both atomic.Int32
	sctx, stopSampling := context.WithCancel(ctx)
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for sctx.Err() == nil {
			if agents["agent-a"].role() == 1 && agents["agent-b"].role() == 1 {
				both.Add(1)
			}
			time.Sleep(100 * time.Millisecond) // sampling interval of an invariant checked until the end
		}
	}()
	defer func() { stopSampling(); <-sampled }()

	startDNSMasq(t, dir)

	// The standby serves the image cache at all times.
	resp, err := http.Get("http://" + net.JoinHostPort(standby.ip, "8080") + "/images/sha256/" + digest(initrd))
	require.NoError(t, err)
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, initrd, got, "the standby serves the cache")
	resp, err = http.Get("http://" + net.JoinHostPort(standby.ip, "8080") + "/boot/52-54-00-00-00-01.ipxe")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, "the standby serves no scripts")

	// Boot files over HTTP (UEFI HTTP boot): the active agent serves the
	// TFTP root, the standby does not, nothing leaves the root.
	require.NoError(t, os.Symlink("/etc/hostname", filepath.Join(tftpRoot, "escape")))
	efi, err := os.ReadFile(ipxeEFI)
	require.NoError(t, err)
	for _, c := range []struct {
		agent *agentProc
		path  string
		code  int
	}{
		{active, "/tftp/ipxe.efi", http.StatusOK},
		{standby, "/tftp/ipxe.efi", http.StatusServiceUnavailable},
		{active, "/tftp/escape", http.StatusBadRequest},
		{active, "/tftp/..%2f..%2fetc%2fhostname", http.StatusBadRequest},
		{active, "/tftp/nothing.efi", http.StatusNotFound},
	} {
		resp, err := http.Get("http://" + net.JoinHostPort(c.agent.ip, "8080") + c.path)
		require.NoError(t, err)
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, c.code, resp.StatusCode, "%s %s: %s", c.agent.id, c.path, body)
		if c.code == http.StatusOK {
			require.Equal(t, efi, body)
		}
	}

	// VM 1: UEFI through the active agent.
	mac1 := "52:54:00:00:00:01"
	start1 := time.Now()
	vm1 := startVM(t, dir, "vm1", "tap0", mac1, true)
	steps1 := observeChain(t, active, mac1, start1, "ipxe.efi", digest(kernel), vm1)
	_, answeredByStandby := standby.find(start1, "PXE request answered", nil)
	require.False(t, answeredByStandby, "the standby answered nothing")
	require.Greater(t, standby.metric("leasehold_site_dhcp_packets_total", "standby"), 0.0,
		"the standby received the VM's broadcasts and dropped them")
	vm1.stop()
	logSteps(t, "UEFI VM 1 through the active agent", steps1)

	// Kill the active agent; the standby is promoted after the lease runs out.
	killedAt := time.Now()
	active.Kill()
	require.Eventually(t, func() bool { return standby.role() == 1 }, 60*time.Second, 100*time.Millisecond, "the standby is promoted")
	t.Logf("killed %s; %s active after %s", active.id, standby.id, time.Since(killedAt).Round(time.Millisecond))

	mac2 := "52:54:00:00:00:02"
	start2 := time.Now()
	vm2 := startVM(t, dir, "vm2", "tap1", mac2, true)
	steps2 := observeChain(t, standby, mac2, start2, "ipxe.efi", digest(kernel), vm2)
	vm2.stop()
	logSteps(t, "UEFI VM 2 through the promoted standby", steps2)

	// Legacy BIOS: SeaBIOS, whose PXE is the NIC's option ROM. QEMU's (and
	// Debian's) legacy NIC ROMs are iPXE itself, which announces itself as
	// iPXE: it gets its script at once, with no undionly.kpxe over TFTP
	// (that path is what a vendor PXE ROM takes; the TFTP tests cover it).
	if !exists(seabios) || !exists(pxeROM) {
		t.Logf("legacy BIOS boot not run: %s or %s missing (Debian packages seabios, ipxe-qemu)", seabios, pxeROM)
	} else {
		mac3 := "52:54:00:00:00:03"
		start3 := time.Now()
		vm3 := startVM(t, dir, "vm3", "tap2", mac3, false)
		steps3 := observeChain(t, standby, mac3, start3, "", digest(kernel), vm3)
		vm3.stop()
		logSteps(t, "BIOS VM 3 through the promoted standby", steps3)
	}

	stopSampling()
	<-sampled
	require.Zero(t, both.Load(), "both agents were active at some sample")
	o.mu.Lock()
	t.Logf("origin requests: kernel %d, initrd %d (one per agent cache at most, plus resumptions)", o.hits[digest(kernel)], o.hits[digest(initrd)])
	o.mu.Unlock()
}

// step is one observed step of a boot and when it happened (agent log time).
type step struct {
	name string
	at   time.Time
	note string
}

// observeChain waits for the whole boot chain of mac in p's logs.
func observeChain(t *testing.T, p *agentProc, mac string, since time.Time, bootFile, kernelDigest string, vm *vm) []step {
	t.Helper()
	var steps []step
	wait := func(name, msg string, want map[string]string, limit time.Duration) logLine {
		t.Helper()
		var l logLine
		deadline := time.Now().Add(limit)
		for {
			var ok bool
			if l, ok = p.find(since, msg, want); ok {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: no %q in %s's log within %s\n--- serial console of %s ---\n%s", name, msg, p.id, limit, vm.name, vm.console())
			}
			time.Sleep(200 * time.Millisecond) // poll interval of a loop bounded by its deadline
		}
		note := ""
		if ns, ok := l.fields["took"].(float64); ok { // slog's JSON duration: nanoseconds
			note = time.Duration(ns).Round(time.Millisecond).String()
		}
		steps = append(steps, step{name: name, at: l.at, note: note})
		since = l.at
		return l
	}
	if bootFile != "" {
		wait("firmware PXE: proxy DHCP offer", "PXE request answered", map[string]string{"mac": mac, "ipxe": "false", "message": "DISCOVER", "boot_file": bootFile}, 5*time.Minute)
		wait("TFTP "+bootFile+" completed", "TFTP transfer completed", map[string]string{"file": bootFile}, 3*time.Minute)
	}
	wait("iPXE: proxy DHCP offer", "PXE request answered", map[string]string{"mac": mac, "ipxe": "true"}, 5*time.Minute)
	wait("iPXE script over HTTP", "iPXE script served", map[string]string{"mac": mac}, 2*time.Minute)
	wait("kernel from the image cache", "image served", map[string]string{"digest": kernelDigest}, 2*time.Minute)
	// Every step of this boot in the agent's log, for the record.
	var b strings.Builder
	for _, l := range p.lines() {
		if l.at.Before(steps[0].at) || l.at.After(since) {
			continue
		}
		switch l.msg {
		case "PXE request answered":
			fmt.Fprintf(&b, "  %s %s %s ipxe=%v boot_file=%v\n", l.at.Format("15:04:05.000"), l.msg, l.fields["message"], l.fields["ipxe"], l.fields["boot_file"])
		case "proxy DHCP reply sent":
			fmt.Fprintf(&b, "  %s %s %v from %v to %v\n", l.at.Format("15:04:05.000"), l.msg, l.fields["message"], l.fields["from"], l.fields["to"])
		case "TFTP transfer completed", "TFTP transfer ended after option negotiation":
			fmt.Fprintf(&b, "  %s %s %v blksize=%v\n", l.at.Format("15:04:05.000"), l.msg, l.fields["file"], l.fields["blksize"])
		case "iPXE script served", "image served":
			fmt.Fprintf(&b, "  %s %s %v\n", l.at.Format("15:04:05.000"), l.msg, l.fields["digest"])
		}
	}
	t.Logf("%s's log for %s:\n%s", p.id, mac, b.String())
	return steps
}

func logSteps(t *testing.T, title string, steps []step) {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "%s:\n", title)
	for i, s := range steps {
		d := time.Duration(0)
		if i > 0 {
			d = s.at.Sub(steps[i-1].at)
		}
		fmt.Fprintf(&b, "  %-40s +%-8s (total %s)", s.name, d.Round(time.Millisecond), s.at.Sub(steps[0].at).Round(time.Millisecond))
		if s.note != "" {
			fmt.Fprintf(&b, " took=%s", s.note)
		}
		b.WriteString("\n")
	}
	t.Log(b.String())
}

// startDNSMasq runs dnsmasq on the bridge as the site's ordinary DHCP
// server: addresses only, no boot options, no DNS.
func startDNSMasq(t *testing.T, dir string) {
	t.Helper()
	logs := &proctest.Buffer{}
	cmd := exec.Command("dnsmasq", "--keep-in-foreground", "--log-facility=-", "--conf-file=/dev/null", "--port=0",
		"--interface=br0", "--bind-interfaces", "--dhcp-range=10.77.0.100,10.77.0.199,255.255.255.0,10m",
		"--dhcp-leasefile="+filepath.Join(dir, "dnsmasq.leases"), "--pid-file="+filepath.Join(dir, "dnsmasq.pid"),
		"--user=root", "--group=root", "--log-dhcp", "--no-resolv", "--no-hosts")
	if os.Getenv("LEASEHOLD_VMBOOT_RA") != "0" {
		// Router advertisements, as on a network with IPv6: iPXE waits for
		// one after DHCP (see docs/site-agent.md).
		cmd.Args = append(cmd.Args, "--enable-ra", "--dhcp-range=::,constructor:br0,ra-only")
	}
	cmd.Stdout, cmd.Stderr = logs, logs
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	require.NoError(t, cmd.Start())
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-done
		if t.Failed() {
			t.Logf("--- dnsmasq ---\n%s", logs.String())
		}
	})
}

// vm is a running QEMU.
type vm struct {
	name, serial string
	cmd          *exec.Cmd
	done         chan struct{}
}

func (v *vm) console() string {
	b, _ := os.ReadFile(v.serial)
	s := string(b)
	if len(s) > 6000 {
		s = "…" + s[len(s)-6000:]
	}
	return s
}

func (v *vm) stop() {
	_ = v.cmd.Process.Kill()
	<-v.done
}

// startVM boots a VM from the network: OVMF (UEFI) with its own virtio-net
// driver and PXE (no option ROM), or SeaBIOS with the NIC's iPXE option
// ROM as its PXE stack.
func startVM(t *testing.T, dir, name, tap, mac string, uefi bool) *vm {
	t.Helper()
	v := &vm{name: name, serial: filepath.Join(dir, name+".serial"), done: make(chan struct{})}
	args := []string{"-machine", "q35,accel=tcg", "-m", "256", "-smp", "1", "-nodefaults", "-display", "none",
		"-serial", "file:" + v.serial, "-no-reboot",
		"-netdev", "tap,id=n0,ifname=" + tap + ",script=no,downscript=no"}
	if uefi {
		vars := filepath.Join(dir, name+"-vars.fd")
		copyFile(t, ovmfVars, vars)
		args = append(args, "-drive", "if=pflash,format=raw,unit=0,readonly=on,file="+ovmfCode,
			"-drive", "if=pflash,format=raw,unit=1,file="+vars,
			"-device", "virtio-net-pci,netdev=n0,mac="+mac+",romfile=")
	} else {
		args = append(args, "-bios", seabios, "-boot", "n", "-device", "e1000,netdev=n0,mac="+mac+",romfile="+pxeROM)
	}
	v.cmd = exec.Command("qemu-system-x86_64", args...)
	out := &proctest.Buffer{}
	v.cmd.Stdout, v.cmd.Stderr = out, out
	v.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	require.NoError(t, v.cmd.Start())
	go func() { _ = v.cmd.Wait(); close(v.done) }()
	t.Cleanup(func() {
		v.stop()
		if t.Failed() {
			t.Logf("--- qemu %s ---\n%s", name, out.String())
		}
	})
	return v
}
