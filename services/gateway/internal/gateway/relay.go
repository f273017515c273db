package gateway

// The relay listener (docs/gateway.md, "Tunnels"): GatewayRelayService on
// its own listener, apart from node streams (which may require client
// certificates of nodes), over TLS (mTLS: the api's client certificate)
// or h2c on a trusted network, behind a shared bearer token, or the
// certificate alone, or both. Its address is published in gateway_relays
// under the gateway lease, so the api can dial the gateway that holds a
// node's session.

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/http"
	"slices"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/leasehold/leasehold/pkg/gen/leasehold/relay/v1/relayv1connect"
	"github.com/leasehold/leasehold/pkg/relaytoken"
	"github.com/leasehold/leasehold/pkg/reload"
)

// publishRelaySQL records the relay address, fenced on the gateway lease.
const publishRelaySQL = `
INSERT INTO gateway_relays (gateway_id, relay_addr, lease_epoch) VALUES ($1, $2, $3)
ON CONFLICT (gateway_id) DO UPDATE SET relay_addr = excluded.relay_addr, lease_epoch = excluded.lease_epoch, updated_at = compute_now()`

// relayAuth authenticates the api on the relay: the shared token (followed
// on change) and, with --gateway.relay-tls.client-ca-file, a verified
// client certificate that names --gateway.relay-tls.client-name.
type relayAuth struct {
	tls        *reload.TLS       // nil: h2c
	token      *relaytoken.Token // nil: no token (mTLS alone)
	clientName string            // "" unless a client certificate is required
}

// loadRelayAuth loads the relay's TLS files and token (nil without a
// relay); their errors name the flag.
func loadRelayAuth(cfg Config, deps Deps) (*relayAuth, error) {
	if cfg.RelayListenAddr == "" {
		return nil, nil
	}
	opts := reload.Options{Logger: deps.Logger, Registerer: deps.Registry, Clock: deps.Clock}
	a := &relayAuth{}
	if cfg.RelayTokenFile != "" {
		t, err := relaytoken.Watch("gateway-relay-token", "--gateway.relay-token-file", cfg.RelayTokenFile, opts)
		if err != nil {
			return nil, err
		}
		a.token = t
	}
	if cfg.RelayTLS.Cert != "" {
		base := &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"h2"}}
		t, err := reload.NewTLS("gateway-relay", cfg.RelayTLS, base, opts)
		if err != nil {
			return nil, fmt.Errorf("load --gateway.relay-tls.cert-file %s / --gateway.relay-tls.key-file %s / --gateway.relay-tls.client-ca-file %q: %w",
				cfg.RelayTLS.Cert, cfg.RelayTLS.Key, cfg.RelayTLS.ClientCA, err)
		}
		a.tls = t
		if cfg.RelayTLS.ClientCA != "" {
			a.clientName = cfg.RelayClientName
		}
	}
	return a, nil
}

// check authenticates one relay call; the error says why it was refused.
// The handshake already verified a client certificate's chain; here it
// must also name the api.
func (a *relayAuth) check(r *http.Request) error {
	if a.clientName != "" {
		if r.TLS == nil || len(r.TLS.VerifiedChains) == 0 {
			return errors.New("no verified client certificate")
		}
		if leaf := r.TLS.VerifiedChains[0][0]; !certNames(leaf, a.clientName) {
			return fmt.Errorf("client certificate %q does not name %q (--gateway.relay-tls.client-name)", leaf.Subject.CommonName, a.clientName)
		}
	}
	if a.token != nil && !a.token.Authorizes(r.Header.Get("Authorization")) {
		return errors.New("bad or missing token")
	}
	return nil
}

// peer is how the api was authenticated, as recorded beside a tunnel's
// actor: the client certificate's name under mTLS, else the token.
func (a *relayAuth) peer() string {
	switch {
	case a == nil:
		return "none"
	case a.clientName != "":
		return "certificate:" + a.clientName
	default:
		return "token"
	}
}

// run re-reads the relay's files every interval until ctx ends.
func (a *relayAuth) run(ctx context.Context, every time.Duration) {
	var wg sync.WaitGroup
	if a.token != nil {
		wg.Go(func() { a.token.Run(ctx, every) })
	}
	if a.tls != nil {
		wg.Go(func() { a.tls.Run(ctx, every) })
	}
	wg.Wait()
}

// certNames reports whether c names name as a DNS SAN or, without DNS
// SANs, as its CommonName.
func certNames(c *x509.Certificate, name string) bool {
	if len(c.DNSNames) > 0 {
		return slices.Contains(c.DNSNames, name)
	}
	return c.Subject.CommonName == name
}

// startRelay listens on --gateway.relay-listen-addr and publishes the
// advertised address; a no-op when no relay is configured.
func (g *Gateway) startRelay(ctx context.Context) error {
	if g.relayAuth == nil {
		return nil
	}
	mux := http.NewServeMux()
	path, h := relayv1connect.NewGatewayRelayServiceHandler(g, connect.WithReadMaxBytes(2*maxTunnelChunk), connect.WithSendMaxBytes(max(2*maxTunnelChunk, maxOutputPiece+4096)),
		connect.WithCompressMinBytes(math.MaxInt)) // tunnel bytes are relayed as they are
	mux.Handle(path, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := g.relayAuth.check(r); err != nil {
			g.log.Warn("relay call refused", "peer", r.RemoteAddr, "reason", err.Error())
			g.m.tunnelsRefused.WithLabelValues("unauthenticated").Inc()
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			_, _ = w.Write([]byte(`{"code":"unauthenticated","message":"relay caller not authenticated"}`))
			return
		}
		// The body is closed from outside to break a pending Receive when
		// the tunnel ends.
		h.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), bodyKey{}, r.Body)))
	}))
	ln, err := net.Listen("tcp", g.cfg.RelayListenAddr)
	if err != nil {
		return fmt.Errorf("listen on --gateway.relay-listen-addr %s: %w", g.cfg.RelayListenAddr, err)
	}
	addr := g.cfg.RelayAdvertiseAddr
	if addr == "" {
		addr = ln.Addr().String()
	}
	l, _ := g.keeper.Current()
	if err := g.runFenced(ctx, func(ctx context.Context, tx pgxTx) error {
		_, err := tx.Exec(ctx, publishRelaySQL, g.id, addr, l.Epoch)
		return err
	}); err != nil {
		_ = ln.Close()
		return fmt.Errorf("publish relay address: %w", err)
	}
	protocols := new(http.Protocols)
	if g.relayAuth.tls != nil {
		protocols.SetHTTP2(true)
		ln = tls.NewListener(ln, g.relayAuth.tls.ServerConfig())
	} else {
		protocols.SetUnencryptedHTTP2(true)
	}
	// A relay connection carries long tunnels as HTTP/2 streams: pings find
	// a dead api; a connection with no stream closes after the idle
	// timeout; headers are bounded like the node listener's.
	g.relaySrv = &http.Server{Handler: mux, ReadHeaderTimeout: readHeaderTimeout, MaxHeaderBytes: maxHeaderBytes,
		IdleTimeout: relayIdleTimeout, Protocols: protocols,
		ErrorLog: slog.NewLogLogger(g.log.Handler(), slog.LevelDebug),
		HTTP2: &http.HTTP2Config{SendPingTimeout: pingInterval, PingTimeout: pingTimeout, MaxReadFrameSize: 1 << 20,
			MaxDecoderHeaderTableSize: maxHeaderBytes, MaxEncoderHeaderTableSize: maxHeaderBytes}}
	g.relayLn = ln
	go func() {
		if err := g.relaySrv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			g.log.Error("relay listener failed", "err", err)
		}
	}()
	g.log.Info("tunnel relay serving", "listen", ln.Addr().String(), "advertised", addr, "tls", g.relayAuth.tls != nil,
		"client_certificate", g.relayAuth.clientName, "token", g.relayAuth.token != nil)
	return nil
}

// relayIdleTimeout closes a relay connection that carried no stream for
// this long (an api that dialled and went quiet, or a stranger that never
// sent a request).
const relayIdleTimeout = 2 * time.Minute

// RelayAddr is the relay listener's address once started ("" without one).
func (g *Gateway) RelayAddr() string {
	if g.relayLn == nil {
		return ""
	}
	return g.relayLn.Addr().String()
}

// stopRelay closes the relay listener and every tunnel on it.
func (g *Gateway) stopRelay() {
	if g.relaySrv != nil {
		_ = g.relaySrv.Close()
	}
}
