package api

import (
	"flag"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestConfigValidateNamesFlags(t *testing.T) {
	t.Parallel()
	var c Config
	fs := flag.NewFlagSet("api", flag.ContinueOnError)
	c.RegisterFlags("", fs)
	require.NoError(t, fs.Parse(nil))
	require.ErrorContains(t, c.Validate(), "no API tokens")
	c.Tokens = "viewer:" + viewerToken
	require.NoError(t, c.Validate())

	bad := c
	bad.MaxMessageBytes, bad.DefaultCommandTimeout, bad.WaitPollInterval, bad.TLSCert = 10, time.Millisecond, time.Hour, "x.pem"
	err := bad.Validate()
	for _, want := range []string{"--api.max-message-bytes", "--api.default-command-timeout", "--api.wait-poll-interval", "--api.tls-cert"} {
		require.ErrorContains(t, err, want)
	}
	bad = c
	bad.MaxPayloadBytes = bad.MaxMessageBytes
	require.ErrorContains(t, bad.Validate(), "--api.max-payload-bytes", "a payload must leave room for its message")
	bad.MaxMessageBytes, bad.MaxPayloadBytes = 16<<20, 15<<20
	require.NoError(t, bad.Validate(), "a larger payload with a larger message")
	bad = c
	bad.Tokens = "admin:too-short"
	require.ErrorContains(t, bad.Validate(), "LEASEHOLD_API_TOKENS line 1")
	require.NotContains(t, bad.Validate().Error(), "too-short")
}
