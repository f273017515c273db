package cli

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"

	"gopkg.in/yaml.v3"
)

// Config is the CLI's configuration file: named contexts (an api and where
// its token comes from) and the current one. It never holds a token.
type Config struct {
	// CurrentContext names the context used when neither --context nor
	// LEASEHOLD_CONTEXT picks one.
	CurrentContext string `yaml:"current-context,omitempty"`
	// Contexts are the contexts by name.
	Contexts map[string]*Context `yaml:"contexts,omitempty"`
}

// Context is one api and its credentials' source.
type Context struct {
	// API is the base URL of leasehold-api (http:// for h2c, https:// for TLS).
	API string `yaml:"api"`
	// TokenFile is a file holding the bearer token.
	TokenFile string `yaml:"token-file,omitempty"`
	// TokenEnv names an environment variable holding the bearer token.
	TokenEnv string `yaml:"token-env,omitempty"`
	// CAFile is a PEM file of CA certificates to trust for an https api.
	CAFile string `yaml:"ca-file,omitempty"`
}

var (
	contextNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)
	envNameRE     = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
)

// ConfigPath is where the configuration file is: $LEASEHOLD_CONFIG, else
// $XDG_CONFIG_HOME/leasehold/config.yaml, else
// ~/.config/leasehold/config.yaml.
func ConfigPath(getenv func(string) string) (string, error) {
	if p := getenv("LEASEHOLD_CONFIG"); p != "" {
		return p, nil
	}
	if d := getenv("XDG_CONFIG_HOME"); d != "" {
		return filepath.Join(d, "leasehold", "config.yaml"), nil
	}
	home := getenv("HOME")
	if home == "" {
		h, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("config: no LEASEHOLD_CONFIG, XDG_CONFIG_HOME or home directory: %w", err)
		}
		home = h
	}
	return filepath.Join(home, ".config", "leasehold", "config.yaml"), nil
}

// LoadConfig reads the configuration file at path. A missing file is an
// empty configuration. A file that group or others may read or write, that
// holds unknown keys, or whose contexts are invalid is refused with an error
// naming it.
func LoadConfig(path string) (*Config, error) {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return &Config{Contexts: map[string]*Context{}}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("config file %s: %w", path, err)
	}
	defer func() { _ = f.Close() }()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("config file %s: %w", path, err)
	}
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("config file %s has mode %04o: group and others must have no access (chmod 600 %s)", path, perm, path)
	}
	b, err := readAll(f, 1<<20)
	if err != nil {
		return nil, fmt.Errorf("config file %s: %w", path, err)
	}
	c := &Config{}
	if len(bytes.TrimSpace(b)) > 0 {
		dec := yaml.NewDecoder(bytes.NewReader(b))
		dec.KnownFields(true)
		if err := dec.Decode(c); err != nil {
			return nil, fmt.Errorf("config file %s: %w", path, err)
		}
	}
	if c.Contexts == nil {
		c.Contexts = map[string]*Context{}
	}
	for _, name := range c.Names() {
		if err := c.Contexts[name].validate(name); err != nil {
			return nil, fmt.Errorf("config file %s: %w", path, err)
		}
	}
	if c.CurrentContext != "" && c.Contexts[c.CurrentContext] == nil {
		return nil, fmt.Errorf("config file %s: current-context %q is not among its contexts", path, c.CurrentContext)
	}
	return c, nil
}

func readAll(f *os.File, limit int64) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("larger than %d bytes", limit)
	}
	return b, nil
}

// Names are the contexts' names, sorted.
func (c *Config) Names() []string {
	names := make([]string, 0, len(c.Contexts))
	for n := range c.Contexts {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// validate checks a context as stored.
func (x *Context) validate(name string) error {
	if x == nil {
		return fmt.Errorf("context %q is empty", name)
	}
	if !contextNameRE.MatchString(name) {
		return fmt.Errorf("context name %q: must match %s", name, contextNameRE)
	}
	if err := validateAPI(x.API); err != nil {
		return fmt.Errorf("context %q: api: %w", name, err)
	}
	if x.TokenFile != "" && x.TokenEnv != "" {
		return fmt.Errorf("context %q: token-file and token-env are exclusive", name)
	}
	if x.TokenEnv != "" && !envNameRE.MatchString(x.TokenEnv) {
		return fmt.Errorf("context %q: token-env %q is not an environment variable name", name, x.TokenEnv)
	}
	if x.CAFile != "" && !strings.HasPrefix(x.API, "https://") {
		return fmt.Errorf("context %q: ca-file needs an https:// api", name)
	}
	return nil
}

// validateAPI checks an api base URL: http or https, a host, no user
// information, query or fragment.
func validateAPI(s string) error {
	if s == "" {
		return errors.New("missing (an http:// or https:// URL)")
	}
	u, err := url.Parse(s)
	if err != nil {
		return fmt.Errorf("%q is not a URL", s)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return fmt.Errorf("%q: the scheme must be http or https", s)
	}
	if u.Host == "" {
		return fmt.Errorf("%q has no host", s)
	}
	if u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return fmt.Errorf("%q: no user, query or fragment", s)
	}
	return nil
}

// Save writes c to path atomically with mode 0600: a temporary file in the
// same directory, synced, then renamed over path. The directory is created
// 0700 when missing.
func (c *Config) Save(path string) error {
	var out bytes.Buffer
	enc := yaml.NewEncoder(&out)
	enc.SetIndent(2)
	if err := enc.Encode(c); err != nil {
		return fmt.Errorf("config file %s: %w", path, err)
	}
	_ = enc.Close()
	b := out.Bytes()
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("config file %s: %w", path, err)
	}
	tmp, err := os.CreateTemp(dir, ".config-*.yaml")
	if err != nil {
		return fmt.Errorf("config file %s: %w", path, err)
	}
	done := false
	defer func() {
		if !done {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	if err := tmp.Chmod(0o600); err != nil {
		return fmt.Errorf("config file %s: %w", path, err)
	}
	if _, err := tmp.Write(b); err != nil {
		return fmt.Errorf("config file %s: %w", path, err)
	}
	if err := tmp.Sync(); err != nil {
		return fmt.Errorf("config file %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("config file %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("config file %s: %w", path, err)
	}
	done = true
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		_ = d.Close()
	}
	return nil
}

// absPath makes p absolute, so a context works from any directory.
func absPath(p string) string {
	if abs, err := filepath.Abs(p); err == nil {
		return abs
	}
	return p
}
