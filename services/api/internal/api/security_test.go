package api

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/base64"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
)

// countingReader records how many bytes were read from it.
type countingReader struct {
	r io.Reader
	n atomic.Int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	k, err := c.r.Read(p)
	c.n.Add(int64(k))
	return k, err
}

// bomb returns gzip of size zero bytes: a few KiB that expand to size.
func bomb(t *testing.T, size int) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw, err := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	require.NoError(t, err)
	zero := make([]byte, 1<<20)
	for range size >> 20 {
		_, err := zw.Write(zero)
		require.NoError(t, err)
	}
	require.NoError(t, zw.Close())
	return buf.Bytes()
}

// TestNoTokenNoBodyRead: without a valid token the api answers
// UNAUTHENTICATED in the caller's protocol without reading one byte of the
// body, whatever the body is: valid JSON, malformed JSON, or a gzip bomb.
// A viewer calling an admin method is refused the same way.
func TestNoTokenNoBodyRead(t *testing.T) {
	t.Parallel()
	b := setup(t)
	gz := bomb(t, 64<<20)
	const procedure = "/leasehold.control.v1.ControlService/ListNodes"
	cases := []struct {
		name, path, contentType, encoding, token string
		body                                     []byte
		status                                   int
		grpcStatus                               string
	}{
		{"connect json, no token", procedure, "application/json", "", "", []byte(`{}`), http.StatusUnauthorized, ""},
		{"malformed json, no token", procedure, "application/json", "", "", []byte(`{"pageSize": `), http.StatusUnauthorized, ""},
		{"malformed json, bad token", procedure, "application/json", "", "not-a-valid-token-at-all", []byte(`{{{`), http.StatusUnauthorized, ""},
		{"gzip bomb, no token", procedure, "application/json", "gzip", "", gz, http.StatusUnauthorized, ""},
		{"grpc, no token", procedure, "application/grpc", "", "", []byte{0, 0, 0, 0, 0}, http.StatusOK, "16"},
		{"viewer calls CreateSink", "/leasehold.control.v1.ControlService/CreateSink", "application/json", "", viewerToken, []byte(`{`), http.StatusForbidden, ""},
	}
	for _, c := range cases {
		body := &countingReader{r: bytes.NewReader(c.body)}
		req := httptest.NewRequest(http.MethodPost, c.path, body)
		req.Header.Set("Content-Type", c.contentType)
		if c.encoding != "" {
			req.Header.Set("Content-Encoding", c.encoding)
		}
		if c.token != "" {
			req.Header.Set("Authorization", "Bearer "+c.token)
		}
		if c.contentType == "application/grpc" {
			req.Proto, req.ProtoMajor, req.ProtoMinor = "HTTP/2", 2, 0
			req.Header.Set("Te", "trailers")
		}
		rec := httptest.NewRecorder()
		b.svc.srv.Handler.ServeHTTP(rec, req)
		require.Equal(t, c.status, rec.Code, "%s: %s", c.name, rec.Body.String())
		require.Zero(t, body.n.Load(), "%s: the body was read before the token was checked", c.name)
		if c.grpcStatus != "" {
			require.Equal(t, c.grpcStatus, rec.Header().Get("Grpc-Status"), c.name)
		}
	}

	// Over the network too: malformed JSON is 401 without a token and 400
	// (invalid_argument) with one.
	code, out := b.postJSON(procedure, "", `{"pageSize": `)
	require.Equal(t, http.StatusUnauthorized, code, out)
	require.Equal(t, "unauthenticated", out["code"])
	code, out = b.postJSON(procedure, viewerToken, `{"pageSize": `)
	require.Equal(t, http.StatusBadRequest, code, out)
	require.Equal(t, "invalid_argument", out["code"])
}

// TestCompressedBombIsBounded: an authenticated caller's gzip bomb is
// refused RESOURCE_EXHAUSTED, and the decompressor reads only as much of
// the compressed stream as yields --api.max-message-bytes + 1 bytes, not
// the whole bomb (connect-go's own gzip inflates all of it to report the
// size).
func TestCompressedBombIsBounded(t *testing.T) {
	t.Parallel()
	const limit = 1 << 20
	gz := bomb(t, 64<<20)
	src := &countingReader{r: bytes.NewReader(gz)}
	d := &limitedGzipReader{max: limit}
	require.NoError(t, d.Reset(src))
	n, err := io.Copy(io.Discard, d)
	require.ErrorContains(t, err, "larger than 1048576 bytes")
	require.EqualValues(t, limit+1, n)
	require.Less(t, src.n.Load(), int64(len(gz)/4), "read %d of %d compressed bytes", src.n.Load(), len(gz))
	// A message within the limit decompresses whole, and the reader is reusable.
	var small bytes.Buffer
	zw := gzip.NewWriter(&small)
	_, _ = zw.Write([]byte("hello"))
	require.NoError(t, zw.Close())
	require.NoError(t, d.Reset(&small))
	got, err := io.ReadAll(d)
	require.NoError(t, err)
	require.Equal(t, "hello", string(got))

	// End to end: the Connect protocol with Content-Encoding gzip.
	b := setup(t)
	req, err := http.NewRequest(http.MethodPost, b.base+"/leasehold.control.v1.ControlService/ListNodes", bytes.NewReader(gz))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Content-Encoding", "gzip")
	req.Header.Set("Authorization", "Bearer "+viewerToken)
	resp, err := b.http.Do(req)
	require.NoError(t, err)
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Contains(t, string(raw), `"code":"resource_exhausted"`, string(raw))
	// And a real client's compressed call still works.
	c := b.client(viewerToken, connect.WithSendGzip())
	_, err = c.ListNodes(context.Background(), connect.NewRequest(&controlv1.ListNodesRequest{}))
	require.NoError(t, err)
}

// TestSinkURLPolicyFlags: with --api.sink-allow-loopback and
// --api.sink-allow-private the development URLs are accepted; the metadata
// address never is; a whsec_ secret is accepted.
func TestSinkURLPolicyFlags(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *Config, _ *http.Transport) {
		c.SinkEgress.AllowLoopback, c.SinkEgress.AllowPrivate = true, true
	})
	ctx := context.Background()
	whsec := "whsec_" + base64.StdEncoding.EncodeToString([]byte("a 32-byte key for the test sink!"))
	b.secret(whsec)
	for i, u := range []string{"http://127.0.0.1:9999/hook", "http://localhost/x", "https://10.1.2.3/x", "https://[fd12::1]/x"} {
		_, err := b.admin.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "s" + strings.Repeat("x", i),
			Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: u, Secret: whsec}))
		require.NoError(t, err, u)
	}
	_, err := b.admin.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "meta",
		Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "http://169.254.169.254/", Secret: whsec}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	require.ErrorContains(t, err, "url: 169.254.169.254 is a cloud metadata address")
}
