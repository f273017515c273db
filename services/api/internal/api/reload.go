package api

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"sync"

	"github.com/leasehold/leasehold/pkg/apiauth"
	"github.com/leasehold/leasehold/pkg/reload"
)

// reloaders re-read the tokens file and the TLS files while the api runs
// (docs/runbooks.md, rotation): a file that no longer loads leaves what was
// loaded before in force.
type reloaders struct {
	keys     *apiauth.Store
	tls      *reload.TLS       // nil without --api.tls-cert
	tokens   *reload.Watcher   // nil without --tokens-file
	watchers []*reload.Watcher // the non-nil ones
}

func newReloaders(cfg Config, deps Deps) (*reloaders, error) {
	keys, err := cfg.Keyring()
	if err != nil {
		return nil, err
	}
	if keys.Len() == 0 {
		return nil, fmt.Errorf("no API tokens: give --tokens-file or %s", TokensEnv)
	}
	r := &reloaders{keys: apiauth.NewStore(keys)}
	opts := reload.Options{Logger: deps.Logger, Registerer: deps.Registry}
	if cfg.TokensFile != "" {
		r.tokens, err = reload.NewWatcher("api-tokens", []string{cfg.TokensFile}, func(c [][]byte) error {
			k, err := apiauth.LoadContents("tokens file "+cfg.TokensFile, c[0], cfg.Tokens, TokensEnv)
			if err != nil {
				// A file that does not parse grants nothing new, but a
				// token its valid lines no longer hold (revoked) or hold
				// with a smaller role (demoted) loses it at once: a typo
				// elsewhere in the file must not keep a revoked token
				// working. The reload still fails, so the alert fires.
				// A file with no valid line at all (truncated, half
				// written) takes nothing away: the tokens stay as they are.
				src := "tokens file " + cfg.TokensFile
				if fileOnly, _ := apiauth.LoadContentsLenient(src, c[0], "", ""); fileOnly.Len() == 0 {
					return err
				}
				lenient, _ := apiauth.LoadContentsLenient(src, c[0], cfg.Tokens, TokensEnv)
				if kept := r.keys.Keyring().Restrict(lenient); kept.Len() > 0 && !kept.Equal(r.keys.Keyring()) {
					r.keys.Swap(kept)
					deps.Logger.Warn("tokens file does not parse: tokens it no longer lists are revoked now, new ones wait for a file that parses",
						"file", cfg.TokensFile, "tokens_in_force", kept.Len(), "err", err)
				}
				return err
			}
			if k.Len() == 0 {
				return errors.New("the tokens file and " + TokensEnv + " hold no token: keeping the previous ones")
			}
			r.keys.Swap(k)
			return nil
		}, opts)
		if err != nil {
			return nil, err
		}
		r.watchers = append(r.watchers, r.tokens)
	}
	if cfg.TLSCert != "" {
		base := &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"h2", "http/1.1"}}
		r.tls, err = reload.NewTLS("api", reload.TLSFiles{Cert: cfg.TLSCert, Key: cfg.TLSKey}, base, opts)
		if err != nil {
			return nil, fmt.Errorf("load --api.tls-cert %s / --api.tls-key %s: %w", cfg.TLSCert, cfg.TLSKey, err)
		}
		r.watchers = append(r.watchers, r.tls.Watcher)
	}
	return r, nil
}

// run re-reads every watched file each interval until ctx ends.
func (r *reloaders) run(ctx context.Context, cfg Config) {
	var wg sync.WaitGroup
	for _, w := range r.watchers {
		wg.Go(func() { w.Run(ctx, cfg.ReloadInterval) })
	}
	wg.Wait()
}
