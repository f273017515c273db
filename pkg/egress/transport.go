package egress

import (
	"net"
	"net/http"
	"time"
)

// Transport returns an HTTP transport whose every connection passes
// p.Control. It ignores HTTP_PROXY and friends: through a proxy the dialled
// address would be the proxy's, and the check would mean nothing.
func (p Policy) Transport() *http.Transport {
	d := &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second, Control: p.Control}
	return &http.Transport{
		Proxy:                 nil,
		DialContext:           d.DialContext,
		ForceAttemptHTTP2:     true,
		MaxIdleConns:          16,
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   10 * time.Second,
		ResponseHeaderTimeout: 10 * time.Second,
		ExpectContinueTimeout: time.Second,
	}
}

// Client returns an HTTP client on p.Transport that does not follow
// redirects (a receiver answering 3xx has not accepted the delivery) and
// gives up after timeout.
func (p Policy) Client(timeout time.Duration) *http.Client {
	return &http.Client{
		Transport: p.Transport(),
		Timeout:   timeout,
		CheckRedirect: func(*http.Request, []*http.Request) error {
			return http.ErrUseLastResponse
		},
	}
}
