package gateway

// The HTTP server the node stream is served on: the lean HTTP/2 server
// (h2serve) or net/http's, with the gateway's handlers, timeouts and TLS.

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"time"

	"connectrpc.com/connect"
	"connectrpc.com/grpchealth"
	"connectrpc.com/grpcreflect"

	"github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1/nodev1connect"
	"github.com/leasehold/leasehold/services/gateway/internal/h2serve"
)

type (
	bodyKey     struct{}
	tlsStateKey struct{}
)

// nodeServer is the HTTP/2 server of node streams: h2serve's (lean) or
// net/http's (std).
type nodeServer interface {
	Serve(ln net.Listener) error
	Shutdown(ctx context.Context) error
	Close() error
}

// stdServer serves TLS through ServeTLS when its TLSConfig is set.
type stdServer struct{ *http.Server }

func (s stdServer) Serve(ln net.Listener) error {
	if s.TLSConfig != nil {
		return s.ServeTLS(ln, "", "")
	}
	return s.Server.Serve(ln)
}

// Timings of node stream connections, on both servers.
const (
	readHeaderTimeout = 10 * time.Second
	connIdleTimeout   = 5 * time.Minute
	// A node host that vanishes sends no RST: ping idle connections.
	pingInterval = 15 * time.Second
	pingTimeout  = 5 * time.Second
	writeTimeout = 30 * time.Second
	// maxConnStreams is per connection; a daemon holds one stream.
	maxConnStreams = 16
	// stdStreamWindow is a stream's receive window on net/http's server.
	stdStreamWindow = 256 << 10
	maxHeaderBytes  = 64 << 10
)

// newServer builds the HTTP/2 server of node streams.
func (g *Gateway) newServer() (nodeServer, error) {
	mux := http.NewServeMux()
	path, h := nodev1connect.NewNodeGatewayServiceHandler(g,
		connect.WithReadMaxBytes(g.cfg.MaxMessageBytes),
		connect.WithSendMaxBytes(g.cfg.MaxMessageBytes),
		// Heartbeats and acks are tiny: compressing them costs a
		// compressor per stream and saves nothing.
		connect.WithCompressMinBytes(1024),
	)
	// Keep the request body reachable from the handler: closing it breaks
	// a pending Receive, which is how a session is closed from outside. The
	// TLS state (nil for h2c) carries the client certificate Hello is bound to.
	mux.Handle(path, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := context.WithValue(context.WithValue(r.Context(), bodyKey{}, r.Body), tlsStateKey{}, r.TLS)
		h.ServeHTTP(w, r.WithContext(ctx))
	}))
	mux.Handle(grpchealth.NewHandler(g.checker))
	reflector := grpcreflect.NewStaticReflector(nodev1connect.NodeGatewayServiceName, grpchealth.HealthV1ServiceName)
	mux.Handle(grpcreflect.NewHandlerV1(reflector))
	mux.Handle(grpcreflect.NewHandlerV1Alpha(reflector))

	tc, err := g.tlsConfig()
	if err != nil {
		return nil, err
	}
	if g.cfg.HTTP2Server == HTTP2Lean {
		return &h2serve.Server{
			Handler:              mux,
			TLSConfig:            tc,
			MaxConcurrentStreams: maxConnStreams,
			MaxHeaderListSize:    maxHeaderBytes,
			ReadHeaderTimeout:    readHeaderTimeout,
			WriteTimeout:         writeTimeout,
			PingInterval:         pingInterval,
			PingTimeout:          pingTimeout,
			IdleTimeout:          connIdleTimeout,
			Logger:               g.log,
		}, nil
	}
	protocols := new(http.Protocols)
	srv := &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: readHeaderTimeout,
		IdleTimeout:       connIdleTimeout,
		MaxHeaderBytes:    maxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(g.log.Handler(), slog.LevelDebug),
		Protocols:         protocols,
		HTTP2: &http.HTTP2Config{
			MaxConcurrentStreams: maxConnStreams,
			SendPingTimeout:      pingInterval,
			PingTimeout:          pingTimeout,
			WriteByteTimeout:     writeTimeout,
			// Every stream's window fits in the connection's with room to
			// spare, so tunnels whose bytes wait (their caller reads
			// slowly) cannot take the whole connection window and stall
			// the session stream beside them (net/http's defaults are
			// 1 MiB for both). The lean server has 64 KiB streams in a
			// 1 MiB connection window.
			MaxReceiveBufferPerStream:     stdStreamWindow,
			MaxReceiveBufferPerConnection: (maxConnStreams + 1) * stdStreamWindow,
		},
	}
	if tc == nil {
		protocols.SetUnencryptedHTTP2(true) // h2c: loopback and tests
		return stdServer{srv}, nil
	}
	protocols.SetHTTP2(true)
	srv.TLSConfig = tc
	return stdServer{srv}, nil
}
