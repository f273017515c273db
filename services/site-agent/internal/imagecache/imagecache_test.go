package imagecache

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
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

func newCache(t *testing.T, h http.Handler, mutate func(*Config)) *Cache {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	cfg := Config{Dir: t.TempDir(), Origin: srv.URL, MaxBytes: 1 << 20}
	if mutate != nil {
		mutate(&cfg)
	}
	c, err := New(cfg, srv.Client(), nil, prometheus.NewRegistry())
	require.NoError(t, err)
	return c
}

func TestEvictsLeastRecentlyServedBeyondTheBudget(t *testing.T) {
	t.Parallel()
	o := &origin{files: map[string][]byte{}}
	c := newCache(t, o, func(c *Config) { c.Budget = 300 })
	var ds []string
	for i := range 4 {
		b := []byte(strings.Repeat(string(rune('a'+i)), 100))
		d := digestOf(b)
		o.files[d] = b
		ds = append(ds, d)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /images/sha256/{digest}", c)
	srv := httptest.NewServer(mux)
	defer srv.Close()
	get := func(d string) {
		resp, err := http.Get(srv.URL + "/images/sha256/" + d)
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
	get(ds[0])
	get(ds[1])
	get(ds[2])
	get(ds[0]) // 0 is now more recent than 1
	require.EqualValues(t, 300, c.Total())
	get(ds[3]) // 400 > 300: the least recently served (1) goes
	require.EqualValues(t, 300, c.Total())
	require.True(t, c.Has(ds[0]))
	require.False(t, c.Has(ds[1]))
	_, err := os.Stat(c.Path(ds[1]))
	require.ErrorIs(t, err, os.ErrNotExist)
	require.True(t, c.Has(ds[2]))
	require.True(t, c.Has(ds[3]))
	require.Equal(t, 1.0, testutil.ToFloat64(c.evictions))

	// A restart keeps the order (mtimes) and the total.
	c2, err := New(c.cfg, nil, nil, nil)
	require.NoError(t, err)
	require.EqualValues(t, 300, c2.Total())

	// An image larger than the whole budget is refused, nothing evicted.
	big := []byte(strings.Repeat("z", 301))
	o.files[digestOf(big)] = big
	require.ErrorIs(t, c.Ensure(context.Background(), digestOf(big)), ErrTooLarge)
	require.EqualValues(t, 300, c.Total())
}

// cutOrigin serves content but closes the connection after cut bytes on
// its first answer; it honours Range requests.
type cutOrigin struct {
	content []byte
	cut     int
	ranges  []string
	mu      sync.Mutex
	calls   int
}

func (o *cutOrigin) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	o.mu.Lock()
	o.calls++
	first := o.calls == 1
	o.ranges = append(o.ranges, r.Header.Get("Range"))
	o.mu.Unlock()
	if !first {
		http.ServeContent(w, r, "", time.Time{}, bytes.NewReader(o.content))
		return
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(o.content)))
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(o.content[:o.cut])
	w.(http.Flusher).Flush()
	conn, _, err := w.(http.Hijacker).Hijack()
	if err == nil {
		_ = conn.Close()
	}
}

func TestResumesACutDownloadWithARangeRequest(t *testing.T) {
	t.Parallel()
	content := bytes.Repeat([]byte("0123456789"), 5000)
	o := &cutOrigin{content: content, cut: 12345}
	c := newCache(t, o, nil)
	d := digestOf(content)
	require.NoError(t, c.Ensure(context.Background(), d))
	b, err := os.ReadFile(c.Path(d))
	require.NoError(t, err)
	require.Equal(t, content, b)
	require.Equal(t, []string{"", "bytes=12345-"}, o.ranges)
	require.Equal(t, 1.0, testutil.ToFloat64(c.resumes))
	_, err = os.Stat(c.partialPath(d))
	require.ErrorIs(t, err, os.ErrNotExist)
}

func TestResumesAcrossRequestsAndRestartsWhenTheRangeIsIgnored(t *testing.T) {
	t.Parallel()
	content := bytes.Repeat([]byte("abcdefghij"), 3000)
	d := digestOf(content)
	var calls atomic.Int32
	var sawRange atomic.Bool
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Range") != "" {
			sawRange.Store(true)
		}
		if calls.Add(1) == 1 { // cut, and the cache gives up after one attempt
			w.Header().Set("Content-Length", strconv.Itoa(len(content)))
			_, _ = w.Write(content[:1000])
			w.(http.Flusher).Flush()
			conn, _, _ := w.(http.Hijacker).Hijack()
			_ = conn.Close()
			return
		}
		_, _ = w.Write(content) // ignores Range: 200 with everything
	})
	c := newCache(t, h, func(c *Config) { c.Attempts = 1 })
	err := c.Ensure(context.Background(), d)
	require.ErrorContains(t, err, "download broken after 1000 of 30000 bytes")
	st, err := os.Stat(c.partialPath(d))
	require.NoError(t, err, "the partial download is kept")
	require.EqualValues(t, 1000, st.Size())
	require.NoError(t, c.Ensure(context.Background(), d), "the next request resumes; the origin ignores the range and the cache starts over")
	require.True(t, sawRange.Load())
	b, err := os.ReadFile(c.Path(d))
	require.NoError(t, err)
	require.Equal(t, content, b)
}

func TestAnOriginThatLiesAboutItsLengthIsAClearError(t *testing.T) {
	t.Parallel()
	content := bytes.Repeat([]byte("x"), 4000)
	d := digestOf(content)
	short := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Declares 4000 bytes, always sends 500, ignores Range.
		w.Header().Set("Content-Length", "4000")
		_, _ = w.Write(content[:500])
		w.(http.Flusher).Flush()
		conn, _, _ := w.(http.Hijacker).Hijack()
		_ = conn.Close()
	})
	c := newCache(t, short, nil)
	err := c.Ensure(context.Background(), d)
	require.ErrorIs(t, err, ErrLengthMismatch)
	require.ErrorContains(t, err, "declared 4000 bytes but sends only 500")
	require.False(t, c.Has(d))

	var n atomic.Int32
	changing := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) == 1 {
			w.Header().Set("Content-Length", "4000")
			_, _ = w.Write(content[:100])
			w.(http.Flusher).Flush()
			conn, _, _ := w.(http.Hijacker).Hijack()
			_ = conn.Close()
			return
		}
		w.Header().Set("Content-Range", "bytes 100-4999/5000") // now it is 5000 bytes long
		w.WriteHeader(http.StatusPartialContent)
		_, _ = w.Write(bytes.Repeat([]byte("x"), 4900))
	})
	c = newCache(t, changing, nil)
	err = c.Ensure(context.Background(), d)
	require.ErrorIs(t, err, ErrLengthMismatch)
	require.ErrorContains(t, err, "declared 4000 bytes, then 5000")

	tooBig := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(2<<20))
		w.WriteHeader(http.StatusOK)
	})
	c = newCache(t, tooBig, nil)
	require.ErrorIs(t, c.Ensure(context.Background(), d), ErrTooLarge, "refused from the declared length, before any byte")
}
