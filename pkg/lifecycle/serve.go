package lifecycle

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/grafana/dskit/services"
)

// httpService serves the health mux on --http-addr as a component.
type httpService struct {
	*services.BasicService
	ln  net.Listener
	srv *http.Server
}

func newHTTPService(addr string, h http.Handler, logger *slog.Logger) (*httpService, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on --http-addr %s: %w", addr, err)
	}
	s := &httpService{ln: ln, srv: &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      10 * time.Second,
		IdleTimeout:       60 * time.Second,
		ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
	}}
	s.BasicService = services.NewBasicService(nil, s.running, nil).WithName("http")
	return s, nil
}

func (s *httpService) addr() string { return s.ln.Addr().String() }

func (s *httpService) running(ctx context.Context) error {
	return Serve(ctx, s.srv, s.ln, "health server", 5*time.Second)
}

// Serve runs srv on ln (TLS when srv.TLSConfig is set) until ctx ends, then
// shuts it down gracefully within grace. It returns an error only when the
// server stopped by itself.
func Serve(ctx context.Context, srv *http.Server, ln net.Listener, name string, grace time.Duration) error {
	useTLS := srv.TLSConfig != nil // Serve mutates the TLS settings: read first
	errc := make(chan error, 1)
	go func() {
		if useTLS {
			errc <- srv.ServeTLS(ln, "", "")
		} else {
			errc <- srv.Serve(ln)
		}
	}()
	select {
	case err := <-errc:
		return fmt.Errorf("%s: %w", name, err)
	case <-ctx.Done():
	}
	shutdownCtx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	_ = srv.Shutdown(shutdownCtx)
	<-errc // after Shutdown, Serve returns http.ErrServerClosed: nothing to report
	return nil
}
