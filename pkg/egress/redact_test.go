package egress

import (
	"errors"
	"net/url"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestRedactURLKeepsSchemeAndHost(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"https://hooks.example.com":                "https://hooks.example.com",
		"https://hooks.example.com/":               "https://hooks.example.com",
		"https://hooks.example.com/services/T/B/X": "https://hooks.example.com/…",
		"https://u:p@hooks.example.com:8443":       "https://hooks.example.com:8443/…",
		"https://hooks.example.com?sig=abc":        "https://hooks.example.com/…",
		"https://hooks.example.com#abc":            "https://hooks.example.com/…",
		"not a url":                                "(an unparseable URL)",
		"http://[::1%zone/?sig=abc":                "(an unparseable URL)",
	} {
		require.Equal(t, want, RedactURL(in), in)
	}
}

func TestRedactErrorRewritesTheQuotedURL(t *testing.T) {
	t.Parallel()
	err := RedactError(&url.Error{Op: "Post", URL: "https://h.example/x?token=abc", Err: errors.New("boom")})
	require.Equal(t, `Post "https://h.example/…": boom`, err.Error())
	plain := errors.New("no url here")
	require.Equal(t, plain, RedactError(plain))
}
