package egress

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestMain checks for leaked goroutines (no database is used).
func TestMain(m *testing.M) { pgtest.Main(m) }

func TestCheckAddr(t *testing.T) {
	t.Parallel()
	strict, open := Policy{}, Policy{AllowLoopback: true, AllowPrivate: true}
	cases := []struct {
		addr         string
		strictReason string // "" = allowed
		openReason   string
	}{
		{"93.184.216.34", "", ""},
		{"2606:2800:220:1:248:1893:25c8:1946", "", ""},
		{"127.0.0.1", "loopback", ""},
		{"127.9.9.9", "loopback", ""},
		{"::1", "loopback", ""},
		{"::ffff:127.0.0.1", "loopback", ""},
		{"10.1.2.3", "private", ""},
		{"172.16.0.1", "private", ""},
		{"192.168.1.1", "private", ""},
		{"100.64.0.1", "private", ""},
		{"fd12:3456::1", "private", ""},
		{"169.254.169.254", "cloud metadata", "cloud metadata"},
		{"::ffff:169.254.169.254", "cloud metadata", "cloud metadata"},
		{"fd00:ec2::254", "cloud metadata", "cloud metadata"},
		{"100.100.100.200", "cloud metadata", "cloud metadata"},
		{"64:ff9b::a9fe:a9fe", "cloud metadata", "cloud metadata"},
		{"64:ff9b::7f00:1", "loopback", ""},
		{"169.254.1.1", "link-local", "link-local"},
		{"fe80::1", "link-local", "link-local"},
		{"0.0.0.0", "unspecified", "unspecified"},
		{"0.1.2.3", "unspecified", "unspecified"},
		{"::", "unspecified", "unspecified"},
		{"224.0.0.1", "link-local", "link-local"},
		{"239.1.1.1", "multicast", "multicast"},
		{"ff02::1", "link-local", "link-local"},
		{"ff05::1", "multicast", "multicast"},
		{"255.255.255.255", "reserved or broadcast", "reserved or broadcast"},
		{"240.0.0.1", "reserved or broadcast", "reserved or broadcast"},
	}
	for _, c := range cases {
		ip := netip.MustParseAddr(c.addr)
		for _, pc := range []struct {
			p    Policy
			want string
		}{{strict, c.strictReason}, {open, c.openReason}} {
			err := pc.p.CheckAddr(ip)
			if pc.want == "" {
				require.NoError(t, err, "%s with %+v", c.addr, pc.p)
				continue
			}
			var re *RefusedError
			require.ErrorAs(t, err, &re, "%s with %+v", c.addr, pc.p)
			require.Equal(t, pc.want, re.Reason, c.addr)
			require.ErrorIs(t, err, ErrRefused)
		}
	}
}

func TestCheckURL(t *testing.T) {
	t.Parallel()
	refused := []string{
		"http://localhost:8080/x", "http://LOCALHOST./x", "http://api.localhost/x", "http://127.0.0.1/x",
		"http://[::1]:9/x", "http://169.254.169.254/latest/meta-data/", "http://[fd00:ec2::254]/",
		"http://2130706433/", "http://0x7f.1/", "http://0177.0.0.1/", "http://0/", "http://10.0.0.1/",
	}
	for _, raw := range refused {
		u, err := url.Parse(raw)
		require.NoError(t, err)
		require.ErrorIs(t, Policy{}.CheckURL(u), ErrRefused, raw)
	}
	allowed := []string{"https://hooks.example.com/x", "http://93.184.216.34/", "https://[2606:2800:220:1::1]/", "http://1234.example/"}
	for _, raw := range allowed {
		u, err := url.Parse(raw)
		require.NoError(t, err)
		require.NoError(t, Policy{}.CheckURL(u), raw)
	}
	u, _ := url.Parse("http://localhost:1/")
	require.NoError(t, Policy{AllowLoopback: true}.CheckURL(u))
	u, _ = url.Parse("http://169.254.169.254/")
	require.Error(t, Policy{AllowLoopback: true, AllowPrivate: true}.CheckURL(u), "metadata is never allowed")
}

// TestClientRefusesResolvedLoopback: a name that passes CheckURL (it is
// not an IP literal) but resolves to loopback is refused by the dialer, as
// a rebinding name would be; the receiver never sees a request.
func TestClientRefusesResolvedLoopback(t *testing.T) {
	t.Parallel()
	hits := make(chan struct{}, 10)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hits <- struct{}{} }))
	defer srv.Close()
	_, port, err := net.SplitHostPort(srv.Listener.Addr().String())
	require.NoError(t, err)

	// "localhost" stands in for any name whose DNS answer is loopback.
	target := "http://localhost:" + port + "/hook"
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, target, nil)
	require.NoError(t, err)
	resp, err := Policy{}.Client(5 * time.Second).Do(req)
	if resp != nil {
		_ = resp.Body.Close()
	}
	require.ErrorIs(t, err, ErrRefused)
	require.Contains(t, err.Error(), "loopback address")
	require.Empty(t, hits)

	// Allowed: the same request reaches the receiver.
	req, err = http.NewRequestWithContext(ctx, http.MethodPost, target, nil)
	require.NoError(t, err)
	client := Policy{AllowLoopback: true}.Client(5 * time.Second)
	defer client.CloseIdleConnections()
	resp, err = client.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Len(t, hits, 1)
}

// TestClientDoesNotFollowRedirects: a public-looking receiver cannot bounce
// a delivery to another address with a 3xx.
func TestClientDoesNotFollowRedirects(t *testing.T) {
	t.Parallel()
	var followed bool
	target := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { followed = true }))
	defer target.Close()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, target.URL, http.StatusTemporaryRedirect)
	}))
	defer srv.Close()
	resp, err := Policy{AllowLoopback: true}.Client(5*time.Second).Post(srv.URL, "application/json", nil)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusTemporaryRedirect, resp.StatusCode)
	require.False(t, followed)
	require.False(t, errors.Is(err, ErrRefused))
}
