// Package imagecache is the site agent's content-addressed image cache:
// files named by their sha256, fetched from a configured origin
// (<origin>/<sha256>), verified while they stream to a temporary file, and
// kept only when the digest matches. It serves them over HTTP with range
// requests (http.ServeContent). Both agents of a site run it at all times,
// active or standby.
package imagecache

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// ErrDigestMismatch is returned when a download does not hash to its name.
var ErrDigestMismatch = errors.New("image digest mismatch")

// ErrTooLarge is returned when a download exceeds MaxBytes.
var ErrTooLarge = errors.New("image larger than the cache's limit")

// Config configures the cache.
type Config struct {
	// Dir holds the images as Dir/sha256/<hex>.
	Dir string
	// Origin is the base URL images are fetched from: <Origin>/<hex>.
	Origin string
	// MaxBytes bounds one image (8 GiB).
	MaxBytes int64
	// FetchTimeout bounds one download (10 min).
	FetchTimeout time.Duration
}

// Cache is the image cache.
type Cache struct {
	cfg    Config
	client *http.Client
	log    *slog.Logger

	mu       sync.Mutex
	inflight map[string]*fetch

	fetches *prometheus.CounterVec
}

type fetch struct {
	done chan struct{}
	err  error
}

// New returns a cache over cfg.Dir (created when missing).
func New(cfg Config, client *http.Client, log *slog.Logger, reg prometheus.Registerer) (*Cache, error) {
	if cfg.Dir == "" {
		return nil, errors.New("--cache.dir is required")
	}
	if cfg.MaxBytes <= 0 {
		cfg.MaxBytes = 8 << 30
	}
	if cfg.FetchTimeout <= 0 {
		cfg.FetchTimeout = 10 * time.Minute
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
	c := &Cache{cfg: cfg, client: client, log: log, inflight: map[string]*fetch{},
		fetches: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "leasehold_site_image_fetches_total",
			Help: "Image downloads from the origin by outcome (stored, corrupt, error)."}, []string{"outcome"})}
	if reg != nil {
		reg.MustRegister(c.fetches)
	}
	return c, nil
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

// Has reports whether digest is cached.
func (c *Cache) Has(digest string) bool {
	if !ValidDigest(digest) {
		return false
	}
	_, err := os.Stat(c.Path(digest))
	return err == nil
}

// Ensure makes digest present in the cache, fetching it from the origin
// once even when asked concurrently. A download that does not hash to
// digest is deleted and reported as ErrDigestMismatch.
func (c *Cache) Ensure(ctx context.Context, digest string) error {
	if !ValidDigest(digest) {
		return fmt.Errorf("image %q: not a sha256 digest", digest)
	}
	if c.Has(digest) {
		return nil
	}
	c.mu.Lock()
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

func (c *Cache) download(ctx context.Context, digest string) (err error) {
	defer func() {
		switch {
		case err == nil:
			c.fetches.WithLabelValues("stored").Inc()
		case errors.Is(err, ErrDigestMismatch):
			c.fetches.WithLabelValues("corrupt").Inc()
		default:
			c.fetches.WithLabelValues("error").Inc()
		}
	}()
	url := strings.TrimRight(c.cfg.Origin, "/") + "/" + digest
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return fmt.Errorf("fetch image %s: %w", digest, err)
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return fmt.Errorf("fetch image %s: %w", digest, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("fetch image %s: origin answered %s", digest, resp.Status)
	}
	tmp, err := os.CreateTemp(filepath.Join(c.cfg.Dir, "sha256"), ".partial-*")
	if err != nil {
		return fmt.Errorf("fetch image %s: %w", digest, err)
	}
	defer func() {
		if err != nil {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(tmp, h), io.LimitReader(resp.Body, c.cfg.MaxBytes+1))
	if err != nil {
		return fmt.Errorf("fetch image %s: %w", digest, err)
	}
	if n > c.cfg.MaxBytes {
		return fmt.Errorf("fetch image %s: %w (%d bytes)", digest, ErrTooLarge, c.cfg.MaxBytes)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != digest {
		c.log.Warn("image download rejected: content does not match its digest", "digest", digest, "got", got, "bytes", n)
		return fmt.Errorf("fetch image %s: %w (content hashes to %s)", digest, ErrDigestMismatch, got)
	}
	if err := tmp.Sync(); err != nil {
		return fmt.Errorf("fetch image %s: %w", digest, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("fetch image %s: %w", digest, err)
	}
	if err := os.Rename(tmp.Name(), c.Path(digest)); err != nil {
		return fmt.Errorf("fetch image %s: %w", digest, err)
	}
	c.log.Info("image cached", "digest", digest, "bytes", n)
	return nil
}

// ServeHTTP serves GET/HEAD /images/sha256/{digest} with range requests,
// fetching a missing image from the origin first.
func (c *Cache) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	digest := r.PathValue("digest")
	if !ValidDigest(digest) {
		http.Error(w, "not a sha256 digest", http.StatusBadRequest)
		return
	}
	if err := c.Ensure(r.Context(), digest); err != nil {
		code := http.StatusBadGateway
		if errors.Is(err, ErrDigestMismatch) {
			code = http.StatusBadGateway
		}
		http.Error(w, err.Error(), code)
		return
	}
	f, err := os.Open(c.Path(digest))
	if err != nil {
		http.Error(w, "image vanished", http.StatusInternalServerError)
		return
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("ETag", `"sha256:`+digest+`"`)
	w.Header().Set("Cache-Control", "public, max-age=31536000, immutable")
	http.ServeContent(w, r, "", st.ModTime(), f)
}
