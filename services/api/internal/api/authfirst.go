package api

import (
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/enroll/v1/enrollv1connect"
)

// enrollPathPrefix is the URL path prefix of every EnrollmentService call.
const enrollPathPrefix = "/" + enrollv1connect.EnrollmentServiceName + "/"

// authenticateFirst puts the bearer-token check in front of ControlService
// at the HTTP layer: a call without a valid token, or whose role may not
// call the procedure (the URL path), is answered UNAUTHENTICATED or
// PERMISSION_DENIED in the caller's protocol before a byte of its body is
// read or decompressed, so an anonymous caller can neither make the api
// inflate a compression bomb nor tell valid JSON from invalid. An accepted
// call's raw body is capped at maxMessage plus framing; the interceptor
// checks the token again (defence in depth) and puts the identity in the
// context.
//
// EnrollmentService (/leasehold.enroll.v1.EnrollmentService/) is the one
// exception: its callers have no bearer token (Join carries a join token,
// RotateCredential the node's credential, both checked by the handler), so
// it passes without one, its raw body capped at enrollMaxMessageBytes plus
// framing.
//
// Accepted calls then take a call from their caller's bucket (lim: per
// token, per source address for EnrollmentService); a caller over its rate
// is answered RESOURCE_EXHAUSTED with Retry-After, before its body is read.
func authenticateFirst(auth *authInterceptor, m *metrics, lim *callLimiter, maxMessage int64, next http.Handler) http.Handler {
	errs := connect.NewErrorWriter()
	refuse := func(w http.ResponseWriter, r *http.Request, proc string, err *connect.Error) {
		m.requests.WithLabelValues(proc, err.Code().String()).Inc()
		_ = errs.Write(w, r, err)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, enrollPathPrefix) {
			host := peerHost(r.RemoteAddr)
			if ok, wait := lim.allow("peer:" + host); !ok {
				refuse(w, r, r.URL.Path, lim.refusal("source "+host, wait))
				return
			}
			r.Body = http.MaxBytesReader(w, r.Body, enrollMaxMessageBytes+64<<10)
			next.ServeHTTP(w, r)
			return
		}
		ctx, err := auth.authorize(r.Context(), r.URL.Path, r.Header.Get("Authorization"), r.RemoteAddr)
		if err != nil {
			// Counted as the interceptor counts calls; a path that is no
			// procedure is "unknown", so callers cannot mint label values.
			proc := r.URL.Path
			if _, known := requiredRoles[proc]; !known {
				proc = "unknown"
			}
			m.requests.WithLabelValues(proc, connect.CodeOf(err).String()).Inc()
			_ = errs.Write(w, r, err)
			return
		}
		if id, ok := IdentityFrom(ctx); ok {
			if allowed, wait := lim.allow("token:" + id.ID); !allowed {
				refuse(w, r, r.URL.Path, lim.refusal("token "+id.ID, wait))
				return
			}
		}
		if r.URL.Path == controlv1connect.ControlServiceOpenTunnelProcedure {
			// A tunnel's body is its whole upstream and it lives as long as
			// it carries bytes (the gateway's idle timeout ends it): each
			// message is bounded by the read limit, the stream by nothing,
			// and the server's read and write timeouts do not apply. The
			// body is kept to break a pending Receive when the tunnel ends.
			rc := http.NewResponseController(w)
			_ = rc.SetReadDeadline(time.Time{})
			_ = rc.SetWriteDeadline(time.Time{})
			next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), tunnelBodyKey{}, r.Body)))
			return
		}
		// One message plus envelope headers and an end-of-stream frame.
		r.Body = http.MaxBytesReader(w, r.Body, maxMessage+64<<10)
		next.ServeHTTP(w, r)
	})
}

// boundedGzip replaces connect-go's gzip with a decompressor that stops
// after max+1 bytes. connect-go refuses a message larger than its read
// limit, but first decompresses the rest of it to report the size; this
// one fails instead, so a small compressed bomb costs at most max bytes of
// work even for an authenticated caller.
func boundedGzip(max int64) connect.HandlerOption {
	return connect.WithCompression("gzip",
		func() connect.Decompressor { return &limitedGzipReader{max: max} },
		func() connect.Compressor { return gzip.NewWriter(io.Discard) },
	)
}

type limitedGzipReader struct {
	gz  *gzip.Reader
	max int64
	n   int64
}

func (l *limitedGzipReader) Read(p []byte) (int, error) {
	if l.gz == nil {
		return 0, io.ErrUnexpectedEOF
	}
	left := l.max + 1 - l.n
	if left <= 0 {
		return 0, fmt.Errorf("decompressed message is larger than %d bytes", l.max)
	}
	if int64(len(p)) > left {
		p = p[:left]
	}
	k, err := l.gz.Read(p)
	l.n += int64(k)
	return k, err
}

func (l *limitedGzipReader) Reset(r io.Reader) error {
	l.n = 0
	if l.gz == nil {
		gz, err := gzip.NewReader(r)
		if err != nil {
			return err
		}
		l.gz = gz
		return nil
	}
	return l.gz.Reset(r)
}

func (l *limitedGzipReader) Close() error {
	if l.gz == nil {
		return nil
	}
	return l.gz.Close()
}
