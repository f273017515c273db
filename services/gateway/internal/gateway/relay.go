package gateway

// The relay listener (docs/gateway.md, "Tunnels"): GatewayRelayService on
// its own h2c listener, apart from node streams (which may require client
// certificates the api does not have), behind a shared bearer token. Its
// address is published in gateway_relays under the gateway lease, so the
// api can dial the gateway that holds a node's session.

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/http"

	"connectrpc.com/connect"

	"github.com/leasehold/leasehold/pkg/gen/leasehold/relay/v1/relayv1connect"
	"github.com/leasehold/leasehold/pkg/relaytoken"
)

// publishRelaySQL records the relay address, fenced on the gateway lease.
const publishRelaySQL = `
INSERT INTO gateway_relays (gateway_id, relay_addr, lease_epoch) VALUES ($1, $2, $3)
ON CONFLICT (gateway_id) DO UPDATE SET relay_addr = excluded.relay_addr, lease_epoch = excluded.lease_epoch, updated_at = compute_now()`

// startRelay listens on --gateway.relay-listen-addr and publishes the
// advertised address; a no-op when no relay is configured.
func (g *Gateway) startRelay(ctx context.Context) error {
	if g.cfg.RelayListenAddr == "" {
		return nil
	}
	token, err := relaytoken.Read("--gateway.relay-token-file", g.cfg.RelayTokenFile)
	if err != nil {
		return err
	}
	want := "Bearer " + token
	mux := http.NewServeMux()
	path, h := relayv1connect.NewGatewayRelayServiceHandler(g, connect.WithReadMaxBytes(2*maxTunnelChunk), connect.WithSendMaxBytes(2*maxTunnelChunk),
		connect.WithCompressMinBytes(math.MaxInt)) // tunnel bytes are relayed as they are
	mux.Handle(path, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if subtle.ConstantTimeCompare([]byte(r.Header.Get("Authorization")), []byte(want)) != 1 {
			g.log.Warn("relay call refused: bad or missing token", "peer", r.RemoteAddr)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			_, _ = w.Write([]byte(`{"code":"unauthenticated","message":"relay token not accepted"}`))
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
	protocols.SetUnencryptedHTTP2(true)
	g.relaySrv = &http.Server{Handler: mux, ReadHeaderTimeout: readHeaderTimeout, Protocols: protocols,
		ErrorLog: slog.NewLogLogger(g.log.Handler(), slog.LevelDebug),
		HTTP2:    &http.HTTP2Config{SendPingTimeout: pingInterval, PingTimeout: pingTimeout}}
	g.relayLn = ln
	go func() {
		if err := g.relaySrv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			g.log.Error("relay listener failed", "err", err)
		}
	}()
	g.log.Info("tunnel relay serving", "listen", ln.Addr().String(), "advertised", addr)
	return nil
}

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
