package sinks

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/egress"
)

// TestFailedDeliveryQuotesNoSecret: whichever way a delivery fails (the
// egress policy refuses the address, nothing listens, the URL does not
// parse, the receiver answers 500), the error the runtime logs names the
// sink and its host but none of the URL's credentials: not the userinfo,
// not the query string, not the path a chat webhook keeps its token in.
func TestFailedDeliveryQuotesNoSecret(t *testing.T) {
	t.Parallel()
	const secret = "s3cr3t-t0ken"
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	closed := ln.Addr().String()
	require.NoError(t, ln.Close())
	failing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusInternalServerError)
	}))
	t.Cleanup(failing.Close)

	open := egress.Policy{AllowLoopback: true}.Client(DeliveryTimeout)
	cases := map[string]Webhook{
		"egress refuses loopback": {URL: "http://user:" + secret + "@" + closed + "/hook?token=" + secret, Client: egress.Policy{}.Client(DeliveryTimeout)},
		"nothing listens":         {URL: "http://" + closed + "/services/" + secret + "?token=" + secret, Client: open},
		"unparseable":             {URL: "http://[::1%" + secret + "/?token=" + secret, Client: open},
		"receiver answers 500":    {URL: failing.URL + "/x?token=" + secret, Client: open},
	}
	for name, w := range cases {
		w.ID, w.Secret = "audit", "signing"
		err := w.deliver(context.Background(), Batch{ID: "msg_1"})
		require.Error(t, err, name)
		require.NotContains(t, err.Error(), secret, name)
		require.True(t, strings.HasPrefix(err.Error(), "sink audit: "), "%s: %v", name, err)
	}
}
