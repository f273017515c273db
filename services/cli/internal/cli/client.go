package cli

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/leasehold/leasehold/pkg/apiclient"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
)

// target is the api a command talks to and where its token comes from.
type target struct {
	// name is the context's name; empty when --api was given without one.
	name string
	api  string
	// tokenFile or tokenEnv is the token's source.
	tokenFile string
	tokenEnv  string
	caFile    string
}

// describeTokenSource says where the token comes from, never what it is.
func (t *target) describeTokenSource() string {
	switch {
	case t.tokenFile != "":
		return "file " + t.tokenFile
	case t.tokenEnv != "":
		return "environment variable " + t.tokenEnv
	}
	return "nowhere"
}

func (t *target) describe() string {
	if t.name == "" {
		return "--api " + t.api
	}
	return fmt.Sprintf("context %q", t.name)
}

const noContextHint = "run 'leasehold context set dev --api http://127.0.0.1:8080 --token-env LEASEHOLD_TOKEN', or pass --api"

// resolveTarget picks the context (--context, LEASEHOLD_CONTEXT, the
// current one) and applies --api and --token-file over it.
func (a *app) resolveTarget() (*target, error) {
	cfg, err := a.loadConfig()
	if err != nil {
		return nil, err
	}
	name := a.contextName
	if name == "" {
		name = a.getenv("LEASEHOLD_CONTEXT")
	}
	t := &target{}
	if name != "" {
		c := cfg.Contexts[name]
		if c == nil {
			return nil, &usageError{err: fmt.Errorf("no context %q in %s", name, a.cfgPath), hint: "leasehold context ls lists them"}
		}
		t = &target{name: name, api: c.API, tokenFile: c.TokenFile, tokenEnv: c.TokenEnv, caFile: c.CAFile}
	} else if cfg.CurrentContext != "" {
		c := cfg.Contexts[cfg.CurrentContext]
		t = &target{name: cfg.CurrentContext, api: c.API, tokenFile: c.TokenFile, tokenEnv: c.TokenEnv, caFile: c.CAFile}
	}
	if a.apiURL != "" {
		if err := validateAPI(a.apiURL); err != nil {
			return nil, usagef("--api: %v", err)
		}
		t.api = a.apiURL
	}
	if a.tokenFile != "" {
		t.tokenFile, t.tokenEnv = a.tokenFile, ""
	}
	if t.api == "" {
		return nil, &usageError{err: errors.New("no context: no current context, --context, LEASEHOLD_CONTEXT or --api"), hint: noContextHint}
	}
	if t.tokenFile == "" && t.tokenEnv == "" {
		t.tokenEnv = "LEASEHOLD_TOKEN"
	}
	return t, nil
}

// token reads the token from its source.
func (a *app) token(t *target) (string, error) {
	if t.tokenFile != "" {
		b, err := os.ReadFile(t.tokenFile)
		if err != nil {
			return "", fmt.Errorf("token file of %s: %w", t.describe(), err)
		}
		tok := strings.TrimSpace(string(b))
		if tok == "" {
			return "", fmt.Errorf("token file %s of %s is empty", t.tokenFile, t.describe())
		}
		return tok, nil
	}
	tok := strings.TrimSpace(a.getenv(t.tokenEnv))
	if tok == "" {
		return "", fmt.Errorf("%s takes its token from environment variable %s, which is not set", t.describe(), t.tokenEnv)
	}
	return tok, nil
}

// httpClient is an HTTP/2 client: h2c for http:// (bidi streams need
// HTTP/2), TLS for https:// with the context's CA file when it has one.
func httpClient(t *target) (*http.Client, error) {
	protocols := new(http.Protocols)
	tr := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		TLSHandshakeTimeout: 10 * time.Second,
		HTTP2:               &http.HTTP2Config{SendPingTimeout: 30 * time.Second, PingTimeout: 15 * time.Second},
	}
	if strings.HasPrefix(t.api, "https://") {
		protocols.SetHTTP1(true)
		protocols.SetHTTP2(true)
		tc := &tls.Config{MinVersion: tls.VersionTLS12}
		if t.caFile != "" {
			pem, err := os.ReadFile(t.caFile)
			if err != nil {
				return nil, fmt.Errorf("ca-file of %s: %w", t.describe(), err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("ca-file %s of %s holds no PEM certificate", t.caFile, t.describe())
			}
			tc.RootCAs = pool
		}
		tr.TLSClientConfig = tc
	} else {
		protocols.SetUnencryptedHTTP2(true)
	}
	tr.Protocols = protocols
	return &http.Client{Transport: tr}, nil
}

// session is a connected ControlService client.
type session struct {
	t      *target
	client controlv1connect.ControlServiceClient
}

// dial resolves the target and returns a client that authenticates every
// call with the target's token.
func (a *app) dial() (*session, error) {
	t, err := a.resolveTarget()
	if err != nil {
		return nil, err
	}
	// Read the token once up front, so a missing one is reported before
	// any call.
	if _, err := a.token(t); err != nil {
		return nil, withHint(err, "leasehold context ls shows where each context's token comes from")
	}
	hc, err := httpClient(t)
	if err != nil {
		return nil, err
	}
	a.debugf("%s: api %s, token from %s", t.describe(), t.api, t.describeTokenSource())
	// Retry wraps Bearer, so each repeat is authenticated afresh.
	interceptors := []connect.Interceptor{
		&apiclient.Retry{For: a.retryFor, OnWait: a.busy},
		apiclient.NewBearer(func(context.Context) (string, error) { return a.token(t) }),
	}
	if a.verbose {
		interceptors = append(interceptors, &logInterceptor{a: a})
	}
	return &session{t: t, client: controlv1connect.NewControlServiceClient(hc, t.api, connect.WithInterceptors(interceptors...))}, nil
}

// busy tells the user why a call is taking longer: the api refused it as
// busy and it is repeated after wait (--retry-for).
func (a *app) busy(procedure string, wait time.Duration, refusal error) {
	_, _ = fmt.Fprintf(a.stderr, "leasehold: %s: the api is busy (%s); trying again in %s (--retry-for %s)\n",
		procedure[strings.LastIndexByte(procedure, '/')+1:], errorLine(refusal), wait.Round(100*time.Millisecond), a.retryFor)
}

// explain adds a hint to the common errors of a call.
func (s *session) explain(err error) error {
	switch connect.CodeOf(err) {
	case connect.CodeUnauthenticated:
		return withHint(err, fmt.Sprintf("%s takes its token from %s, and the api refused it: check that it holds a token leasehold-api knows", s.t.describe(), s.t.describeTokenSource()))
	case connect.CodePermissionDenied:
		return withHint(err, fmt.Sprintf("%s takes its token from %s, whose role may not do this (roles: docs/api.md)", s.t.describe(), s.t.describeTokenSource()))
	case connect.CodeUnavailable:
		var ue x509.UnknownAuthorityError
		var he x509.HostnameError
		if errors.As(err, &ue) || errors.As(err, &he) || strings.Contains(err.Error(), "x509: ") {
			return withHint(err, fmt.Sprintf("the api's certificate is not trusted: give %s the CA that signed it (leasehold context set NAME --ca-file FILE)", s.t.describe()))
		}
		var ne *net.OpError
		if errors.As(err, &ne) {
			return withHint(err, "is leasehold-api running at "+s.t.api+"?")
		}
	}
	return err
}

// logInterceptor logs each call's procedure, code and duration (-v); never
// a header.
type logInterceptor struct{ a *app }

func (l *logInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		start := time.Now()
		res, err := next(ctx, req)
		code := "ok"
		if err != nil {
			code = connect.CodeOf(err).String()
		}
		l.a.debugf("%s %s %s", req.Spec().Procedure, code, time.Since(start).Round(time.Millisecond))
		return res, err
	}
}

func (l *logInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		l.a.debugf("%s stream opened", spec.Procedure)
		return next(ctx, spec)
	}
}

func (l *logInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}
