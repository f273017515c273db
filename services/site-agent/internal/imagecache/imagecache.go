// Package imagecache is the site agent's content-addressed image cache:
// files named by their sha256, fetched from a configured origin
// (<origin>/<sha256>), verified while they stream to a partial file, and
// kept only when the digest matches. It serves them over HTTP with range
// requests (http.ServeContent). Both agents of a site run it at all times,
// active or standby.
//
// Guarantees:
//   - a stored image always hashes to its name: a download that does not is
//     deleted and reported as ErrDigestMismatch;
//   - the images together stay within Config.Budget: after an image is
//     stored, the least recently served others are evicted until the total
//     fits (an image larger than the budget, or than MaxBytes, is refused);
//   - a download cut off part-way is resumed with a Range request from the
//     bytes already on disk (Config.Attempts times per request, and by the
//     next request after that), and restarted from zero when the origin
//     ignores the range;
//   - an origin whose body disagrees with the length it declared
//     (Content-Length or Content-Range) fails with ErrLengthMismatch naming
//     both numbers.
package imagecache

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// ErrDigestMismatch is returned when a download does not hash to its name.
var ErrDigestMismatch = errors.New("image digest mismatch")

// ErrTooLarge is returned when an image exceeds MaxBytes or the budget.
var ErrTooLarge = errors.New("image larger than the cache's limit")

// ErrLengthMismatch is returned when an origin sends a different number of
// bytes than it declared, or declares different lengths for one image.
var ErrLengthMismatch = errors.New("origin lied about the image's length")

// Config configures the cache.
type Config struct {
	// Dir holds the images as Dir/sha256/<hex>.
	Dir string
	// Origin is the base URL images are fetched from: <Origin>/<hex>.
	Origin string
	// MaxBytes bounds one image (8 GiB).
	MaxBytes int64
	// Budget bounds all images together (64 GiB); least recently served
	// images are evicted beyond it.
	Budget int64
	// FetchTimeout bounds one download (10 min).
	FetchTimeout time.Duration
	// Attempts is how many origin requests one download may take when
	// connections break part-way (3).
	Attempts int
}

// Cache is the image cache.
type Cache struct {
	cfg    Config
	client *http.Client
	log    *slog.Logger

	mu       sync.Mutex
	inflight map[string]*fetch
	entries  map[string]*entry // stored images
	total    int64
	seq      uint64 // LRU clock: bumped on every use

	fetches   *prometheus.CounterVec
	evictions prometheus.Counter
	resumes   prometheus.Counter
	bytes     prometheus.Gauge
}

type entry struct {
	size int64
	used uint64
}

type fetch struct {
	done chan struct{}
	err  error
}

// New returns a cache over cfg.Dir (created when missing) and indexes the
// images already there, least recently modified first.
func New(cfg Config, client *http.Client, log *slog.Logger, reg prometheus.Registerer) (*Cache, error) {
	if cfg.Dir == "" {
		return nil, errors.New("--cache.dir is required")
	}
	if cfg.MaxBytes <= 0 {
		cfg.MaxBytes = 8 << 30
	}
	if cfg.Budget <= 0 {
		cfg.Budget = 64 << 30
	}
	if cfg.FetchTimeout <= 0 {
		cfg.FetchTimeout = 10 * time.Minute
	}
	if cfg.Attempts <= 0 {
		cfg.Attempts = 3
	}
	if err := os.MkdirAll(filepath.Join(cfg.Dir, "sha256"), 0o755); err != nil {
		return nil, fmt.Errorf("create --cache.dir: %w", err)
	}
	if client == nil {
		client = &http.Client{}
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	c := &Cache{cfg: cfg, client: client, log: log, inflight: map[string]*fetch{}, entries: map[string]*entry{},
		fetches: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "leasehold_site_image_fetches_total",
			Help: "Image downloads from the origin by outcome (stored, corrupt, length_mismatch, too_large, error)."}, []string{"outcome"}),
		evictions: prometheus.NewCounter(prometheus.CounterOpts{Name: "leasehold_site_image_evictions_total",
			Help: "Images evicted to keep the cache within its budget."}),
		resumes: prometheus.NewCounter(prometheus.CounterOpts{Name: "leasehold_site_image_resumed_downloads_total",
			Help: "Origin requests that resumed a partial download with a Range request."}),
		bytes: prometheus.NewGauge(prometheus.GaugeOpts{Name: "leasehold_site_image_cache_bytes",
			Help: "Bytes of images stored in the cache."}),
	}
	if reg != nil {
		reg.MustRegister(c.fetches, c.evictions, c.resumes, c.bytes)
	}
	if err := c.index(); err != nil {
		return nil, err
	}
	return c, nil
}

// index reads the images already on disk into the LRU, oldest first.
func (c *Cache) index() error {
	des, err := os.ReadDir(filepath.Join(c.cfg.Dir, "sha256"))
	if err != nil {
		return fmt.Errorf("read --cache.dir: %w", err)
	}
	type found struct {
		digest string
		size   int64
		mod    time.Time
	}
	var all []found
	for _, de := range des {
		if !ValidDigest(de.Name()) || !de.Type().IsRegular() {
			continue
		}
		info, err := de.Info()
		if err != nil {
			continue
		}
		all = append(all, found{de.Name(), info.Size(), info.ModTime()})
	}
	sort.Slice(all, func(i, j int) bool { return all[i].mod.Before(all[j].mod) })
	for _, f := range all {
		c.seq++
		c.entries[f.digest] = &entry{size: f.size, used: c.seq}
		c.total += f.size
	}
	c.bytes.Set(float64(c.total))
	return nil
}

// ValidDigest reports whether d is a lowercase hex sha256.
func ValidDigest(d string) bool {
	if len(d) != 64 || strings.ToLower(d) != d {
		return false
	}
	_, err := hex.DecodeString(d)
	return err == nil
}

// Path is where digest is stored.
func (c *Cache) Path(digest string) string { return filepath.Join(c.cfg.Dir, "sha256", digest) }

// partialPath is where an unfinished download of digest is kept for
// resumption.
func (c *Cache) partialPath(digest string) string {
	return filepath.Join(c.cfg.Dir, "sha256", ".partial-"+digest)
}

// Has reports whether digest is cached.
func (c *Cache) Has(digest string) bool {
	if !ValidDigest(digest) {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.entries[digest]
	return ok
}

// Total is the bytes of images stored.
func (c *Cache) Total() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.total
}

// touch marks digest as just used (in memory, and in its mtime so the
// order survives a restart).
func (c *Cache) touch(digest string) {
	c.mu.Lock()
	e, ok := c.entries[digest]
	if ok {
		c.seq++
		e.used = c.seq
	}
	c.mu.Unlock()
	if ok {
		now := time.Now()
		_ = os.Chtimes(c.Path(digest), now, now)
	}
}

// Ensure makes digest present in the cache, fetching it from the origin
// once even when asked concurrently. A download that does not hash to
// digest is deleted and reported as ErrDigestMismatch.
func (c *Cache) Ensure(ctx context.Context, digest string) error {
	if !ValidDigest(digest) {
		return fmt.Errorf("image %q: not a sha256 digest", digest)
	}
	c.mu.Lock()
	if _, ok := c.entries[digest]; ok {
		c.mu.Unlock()
		return nil
	}
	f, ok := c.inflight[digest]
	if !ok {
		f = &fetch{done: make(chan struct{})}
		c.inflight[digest] = f
		go func() {
			fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.FetchTimeout)
			defer cancel()
			f.err = c.download(fctx, digest)
			c.mu.Lock()
			delete(c.inflight, digest)
			c.mu.Unlock()
			close(f.done)
		}()
	}
	c.mu.Unlock()
	select {
	case <-f.done:
		return f.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// limit is the largest image accepted.
func (c *Cache) limit() int64 { return min(c.cfg.MaxBytes, c.cfg.Budget) }

func (c *Cache) download(ctx context.Context, digest string) (err error) {
	defer func() {
		switch {
		case err == nil:
			c.fetches.WithLabelValues("stored").Inc()
		case errors.Is(err, ErrDigestMismatch):
			c.fetches.WithLabelValues("corrupt").Inc()
		case errors.Is(err, ErrLengthMismatch):
			c.fetches.WithLabelValues("length_mismatch").Inc()
		case errors.Is(err, ErrTooLarge):
			c.fetches.WithLabelValues("too_large").Inc()
		default:
			c.fetches.WithLabelValues("error").Inc()
		}
		if err != nil {
			c.log.Warn("image download failed", "digest", digest, "err", err)
		}
	}()
	part, err := os.OpenFile(c.partialPath(digest), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return fmt.Errorf("fetch image %s: %w", digest, err)
	}
	keep := false // keep the partial file for a later resumption
	defer func() {
		_ = part.Close()
		if err != nil && !keep {
			_ = os.Remove(part.Name())
		}
	}()
	// Hash what an earlier attempt left.
	h := sha256.New()
	have, err := io.Copy(h, part)
	if err != nil {
		return fmt.Errorf("fetch image %s: read partial download: %w", digest, err)
	}
	var declared int64 = -1 // the length the origin declared first
	reached := have         // the furthest any attempt got
	for attempt := 1; ; attempt++ {
		var done bool
		done, have, declared, err = c.fetchOnce(ctx, digest, part, h, have, declared)
		if done {
			break
		}
		if !errors.Is(err, errCutShort) {
			return err
		}
		if have <= reached && attempt > 1 && declared >= 0 {
			// A resumed request brought nothing new: the origin's body
			// ends where it ends, short of the length it declared.
			return fmt.Errorf("fetch image %s: %w: it declared %d bytes but sends only %d (%d requests)", digest, ErrLengthMismatch, declared, have, attempt)
		}
		reached = max(reached, have)
		if attempt >= c.cfg.Attempts || ctx.Err() != nil {
			keep = true
			return fmt.Errorf("fetch image %s: download broken after %d of %d bytes in %d requests (kept; the next request resumes it): %w",
				digest, have, declared, attempt, err)
		}
		c.log.Info("image download cut short; resuming", "digest", digest, "have", have, "declared", declared, "attempt", attempt)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != digest {
		c.log.Warn("image download rejected: content does not match its digest", "digest", digest, "got", got, "bytes", have)
		return fmt.Errorf("fetch image %s: %w (content hashes to %s)", digest, ErrDigestMismatch, got)
	}
	if err := part.Sync(); err != nil {
		return fmt.Errorf("fetch image %s: %w", digest, err)
	}
	if err := os.Rename(part.Name(), c.Path(digest)); err != nil {
		return fmt.Errorf("fetch image %s: %w", digest, err)
	}
	c.mu.Lock()
	c.seq++
	c.entries[digest] = &entry{size: have, used: c.seq}
	c.total += have
	c.mu.Unlock()
	c.log.Info("image cached", "digest", digest, "bytes", have)
	c.evict(digest)
	return nil
}

// errCutShort marks a body that ended before its declared end (or a broken
// connection): the download may resume.
var errCutShort = errors.New("body cut short")

// fetchOnce makes one origin request, from byte have on, appending to part
// and h. It returns done when the whole image is on disk.
func (c *Cache) fetchOnce(ctx context.Context, digest string, part *os.File, h hash.Hash, have, declared int64) (bool, int64, int64, error) {
	url := strings.TrimRight(c.cfg.Origin, "/") + "/" + digest
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return false, have, declared, fmt.Errorf("fetch image %s: %w", digest, err)
	}
	if have > 0 {
		req.Header.Set("Range", "bytes="+strconv.FormatInt(have, 10)+"-")
		c.resumes.Inc()
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return false, have, declared, fmt.Errorf("fetch image %s: %w", digest, err)
	}
	defer resp.Body.Close()
	var total int64 // every case below sets it or returns
	switch {
	case resp.StatusCode == http.StatusPartialContent && have > 0:
		start, end, size, ok := parseContentRange(resp.Header.Get("Content-Range"))
		if !ok || start != have {
			return false, have, declared, fmt.Errorf("fetch image %s: origin answered the range from %d with Content-Range %q", digest, have, resp.Header.Get("Content-Range"))
		}
		total = size
		if resp.ContentLength >= 0 && resp.ContentLength != end-start+1 {
			return false, have, declared, fmt.Errorf("fetch image %s: %w: Content-Length %d disagrees with Content-Range %q", digest, ErrLengthMismatch, resp.ContentLength, resp.Header.Get("Content-Range"))
		}
	case resp.StatusCode == http.StatusOK:
		if have > 0 { // the origin ignored the range: start again
			c.log.Info("origin ignored the range request; restarting the download", "digest", digest, "had", have)
			if err := part.Truncate(0); err != nil {
				return false, have, declared, fmt.Errorf("fetch image %s: %w", digest, err)
			}
			if _, err := part.Seek(0, io.SeekStart); err != nil {
				return false, have, declared, fmt.Errorf("fetch image %s: %w", digest, err)
			}
			h.Reset()
			have = 0
		}
		total = resp.ContentLength
	case resp.StatusCode == http.StatusRequestedRangeNotSatisfiable && declared >= 0:
		return false, have, declared, fmt.Errorf("fetch image %s: %w: it declared %d bytes, then refused the range from byte %d", digest, ErrLengthMismatch, declared, have)
	default:
		return false, have, declared, fmt.Errorf("fetch image %s: origin answered %s", digest, resp.Status)
	}
	if total >= 0 {
		if declared >= 0 && total != declared {
			return false, have, declared, fmt.Errorf("fetch image %s: %w: it declared %d bytes, then %d", digest, ErrLengthMismatch, declared, total)
		}
		declared = total
		if total > c.limit() {
			return false, have, declared, fmt.Errorf("fetch image %s: %w: origin declares %d bytes, limit %d", digest, ErrTooLarge, total, c.limit())
		}
	}
	n, err := io.Copy(io.MultiWriter(part, h), io.LimitReader(resp.Body, c.limit()-have+1))
	have += n
	if have > c.limit() {
		return false, have, declared, fmt.Errorf("fetch image %s: %w (%d bytes)", digest, ErrTooLarge, c.limit())
	}
	if err != nil {
		// net/http reports a body shorter than its Content-Length as
		// io.ErrUnexpectedEOF; a reset connection likewise ends here.
		if ctx.Err() != nil {
			return false, have, declared, fmt.Errorf("fetch image %s: %w", digest, ctx.Err())
		}
		return false, have, declared, fmt.Errorf("%w: %w", errCutShort, err)
	}
	if declared >= 0 && have != declared {
		return false, have, declared, fmt.Errorf("%w: body ended at %d of %d bytes", errCutShort, have, declared)
	}
	return true, have, declared, nil
}

// parseContentRange parses "bytes start-end/size" (size required).
func parseContentRange(v string) (start, end, size int64, ok bool) {
	rest, ok := strings.CutPrefix(v, "bytes ")
	if !ok {
		return 0, 0, 0, false
	}
	rng, sz, ok := strings.Cut(rest, "/")
	if !ok {
		return 0, 0, 0, false
	}
	a, b, ok := strings.Cut(rng, "-")
	if !ok {
		return 0, 0, 0, false
	}
	var err1, err2, err3 error
	start, err1 = strconv.ParseInt(a, 10, 64)
	end, err2 = strconv.ParseInt(b, 10, 64)
	size, err3 = strconv.ParseInt(sz, 10, 64)
	if err1 != nil || err2 != nil || err3 != nil || start < 0 || end < start || size <= end {
		return 0, 0, 0, false
	}
	return start, end, size, true
}

// forget drops digest from the index (its file is gone).
func (c *Cache) forget(digest string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.entries[digest]; ok {
		c.total -= e.size
		delete(c.entries, digest)
		c.bytes.Set(float64(c.total))
	}
}

// evict removes the least recently used images other than keep until the
// total fits the budget. A file being served stays readable until its
// reader closes it (it is only unlinked).
func (c *Cache) evict(keep string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.total > c.cfg.Budget {
		victim, oldest := "", uint64(0)
		for d, e := range c.entries {
			if d != keep && (victim == "" || e.used < oldest) {
				victim, oldest = d, e.used
			}
		}
		if victim == "" {
			break
		}
		size := c.entries[victim].size
		if err := os.Remove(c.Path(victim)); err != nil && !errors.Is(err, os.ErrNotExist) {
			c.log.Warn("evict image", "digest", victim, "err", err)
			break
		}
		delete(c.entries, victim)
		c.total -= size
		c.evictions.Inc()
		c.log.Info("image evicted (least recently used) to stay within the cache budget", "digest", victim, "bytes", size,
			"cache_bytes", c.total, "budget", c.cfg.Budget)
	}
	c.bytes.Set(float64(c.total))
}

// ServeHTTP serves GET/HEAD /images/sha256/{digest} with range requests,
// fetching a missing image from the origin first.
func (c *Cache) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	digest := r.PathValue("digest")
	if !ValidDigest(digest) {
		http.Error(w, "not a sha256 digest", http.StatusBadRequest)
		return
	}
	var f *os.File
	for attempt := 0; f == nil; attempt++ {
		if err := c.Ensure(r.Context(), digest); err != nil {
			code := http.StatusBadGateway
			if errors.Is(err, ErrTooLarge) {
				code = http.StatusInsufficientStorage
			}
			http.Error(w, err.Error(), code)
			return
		}
		c.touch(digest)
		var err error
		if f, err = os.Open(c.Path(digest)); err != nil {
			// Evicted between Ensure and Open, or removed by hand:
			// forget it and fetch it again, once.
			c.forget(digest)
			if attempt > 0 {
				http.Error(w, "image vanished from the cache", http.StatusInternalServerError)
				return
			}
		}
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	c.log.Info("image served", "digest", digest, "client", r.RemoteAddr, "method", r.Method, "range", r.Header.Get("Range"), "bytes", st.Size())
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("ETag", `"sha256:`+digest+`"`)
	w.Header().Set("Cache-Control", "public, max-age=31536000, immutable")
	http.ServeContent(w, r, "", st.ModTime(), f)
}
