package imagecache

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

type origin struct {
	mu    sync.Mutex
	files map[string][]byte // digest -> served bytes
	hits  atomic.Int32
}

func (o *origin) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	o.hits.Add(1)
	o.mu.Lock()
	b, ok := o.files[strings.TrimPrefix(r.URL.Path, "/")]
	o.mu.Unlock()
	if !ok {
		http.NotFound(w, r)
		return
	}
	_, _ = w.Write(b)
}

func digestOf(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

func setup(t *testing.T) (*Cache, *origin) {
	t.Helper()
	o := &origin{files: map[string][]byte{}}
	srv := httptest.NewServer(o)
	t.Cleanup(srv.Close)
	c, err := New(Config{Dir: t.TempDir(), Origin: srv.URL, MaxBytes: 1 << 20}, srv.Client(), nil, nil)
	require.NoError(t, err)
	return c, o
}

func TestCorruptDownloadIsRejectedAndNotStored(t *testing.T) {
	t.Parallel()
	c, o := setup(t)
	good := []byte("vmlinuz: the real kernel")
	d := digestOf(good)
	o.files[d] = []byte("vmlinuz: a tampered kernel")
	err := c.Ensure(context.Background(), d)
	require.ErrorIs(t, err, ErrDigestMismatch)
	require.False(t, c.Has(d))
	entries, err := os.ReadDir(filepath.Join(c.cfg.Dir, "sha256"))
	require.NoError(t, err)
	require.Empty(t, entries, "no partial or corrupt file is left behind")

	o.mu.Lock()
	o.files[d] = good
	o.mu.Unlock()
	require.NoError(t, c.Ensure(context.Background(), d))
	b, err := os.ReadFile(c.Path(d))
	require.NoError(t, err)
	require.Equal(t, good, b)
}

func TestTooLargeAndUnknownAndBadDigestsAreRefused(t *testing.T) {
	t.Parallel()
	c, o := setup(t)
	big := make([]byte, 1<<20+1)
	o.files[digestOf(big)] = big
	require.ErrorIs(t, c.Ensure(context.Background(), digestOf(big)), ErrTooLarge)
	require.ErrorContains(t, c.Ensure(context.Background(), digestOf([]byte("missing"))), "404")
	require.ErrorContains(t, c.Ensure(context.Background(), "../../etc/passwd"), "not a sha256 digest")
}

func TestServesRangeRequestsAndFetchesOnce(t *testing.T) {
	t.Parallel()
	c, o := setup(t)
	content := []byte("0123456789abcdefghijklmnopqrstuvwxyz")
	d := digestOf(content)
	o.files[d] = content
	mux := http.NewServeMux()
	mux.Handle("GET /images/sha256/{digest}", c)
	srv := httptest.NewServer(mux)
	defer srv.Close()

	var wg sync.WaitGroup
	for range 8 { // concurrent first requests share one download
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := http.Get(srv.URL + "/images/sha256/" + d)
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}()
	}
	wg.Wait()
	require.EqualValues(t, 1, o.hits.Load())

	req, err := http.NewRequest(http.MethodGet, srv.URL+"/images/sha256/"+d, nil)
	require.NoError(t, err)
	req.Header.Set("Range", "bytes=10-15")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusPartialContent, resp.StatusCode)
	require.Equal(t, "abcdef", string(body))
	require.Equal(t, "bytes 10-15/36", resp.Header.Get("Content-Range"))

	resp2, err := http.Get(srv.URL + "/images/sha256/NOTHEX")
	require.NoError(t, err)
	resp2.Body.Close()
	require.Equal(t, http.StatusBadRequest, resp2.StatusCode)
}
