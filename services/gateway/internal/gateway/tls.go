package gateway

import (
	"context"
	"crypto/tls"
	"fmt"
	"sync"

	"github.com/leasehold/leasehold/pkg/reload"
)

// loadTLS loads the node streams' certificate, key and client CA (nil
// without --tls-cert: h2c). The files are re-read by reloadLoop.
func loadTLS(cfg Config, deps Deps) (*reload.TLS, error) {
	if cfg.TLSCert == "" {
		return nil, nil
	}
	base := &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"h2"}}
	t, err := reload.NewTLS("gateway", reload.TLSFiles{Cert: cfg.TLSCert, Key: cfg.TLSKey, ClientCA: cfg.TLSClientCA}, base,
		reload.Options{Logger: deps.Logger, Registerer: deps.Registry, Clock: deps.Clock})
	if err != nil {
		return nil, fmt.Errorf("load --tls-cert %s / --tls-key %s / --tls-client-ca %q: %w", cfg.TLSCert, cfg.TLSKey, cfg.TLSClientCA, err)
	}
	return t, nil
}

// tlsConfig is the node streams' TLS configuration (nil: h2c): each new
// handshake takes the certificate and client CA in force.
func (g *Gateway) tlsConfig() (*tls.Config, error) {
	if g.tls == nil {
		return nil, nil
	}
	return g.tls.ServerConfig(), nil
}

// reloadLoop re-reads the TLS files, and the relay's files and token,
// every --tls-reload-interval.
func (g *Gateway) reloadLoop(ctx context.Context) {
	var wg sync.WaitGroup
	if g.tls != nil {
		wg.Go(func() { g.tls.Run(ctx, g.cfg.TLSReloadInterval) })
	}
	if g.relayAuth != nil {
		wg.Go(func() { g.relayAuth.run(ctx, g.cfg.TLSReloadInterval) })
	}
	wg.Wait()
}
