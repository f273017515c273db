// Package apiclient holds what a Go client of leasehold-api needs beside the
// generated code: a connect.Interceptor that authenticates every call,
// unary and streaming alike, with a bearer token.
package apiclient

import (
	"context"
	"errors"

	"connectrpc.com/connect"
)

// TokenFunc returns the bearer token for a call. It is asked on every call,
// so a token re-read from a file takes effect on the next one; an error
// fails the call before anything is sent.
type TokenFunc func(ctx context.Context) (string, error)

// StaticToken is a TokenFunc that always returns token.
func StaticToken(token string) TokenFunc {
	return func(context.Context) (string, error) { return token, nil }
}

// Bearer is a connect.Interceptor that sets "Authorization: Bearer <token>"
// on unary calls and on the client side of streaming calls (server, client
// and bidi streams: OpenTunnel, StreamCommandOutput). It does nothing on a
// server's handlers. The token never appears in its errors.
type Bearer struct {
	token TokenFunc
}

// NewBearer returns a Bearer that asks token for each call's token.
func NewBearer(token TokenFunc) *Bearer { return &Bearer{token: token} }

var _ connect.Interceptor = (*Bearer)(nil)

// errNoToken is the error of a call whose TokenFunc returned an empty token.
var errNoToken = errors.New("apiclient: empty bearer token")

func (b *Bearer) header(ctx context.Context) (string, error) {
	tok, err := b.token(ctx)
	if err != nil {
		return "", err
	}
	if tok == "" {
		return "", errNoToken
	}
	return "Bearer " + tok, nil
}

// WrapUnary sets the header on a unary call's request.
func (b *Bearer) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if req.Spec().IsClient {
			h, err := b.header(ctx)
			if err != nil {
				return nil, connect.NewError(connect.CodeUnauthenticated, err)
			}
			req.Header().Set("Authorization", h)
		}
		return next(ctx, req)
	}
}

// WrapStreamingClient sets the header on a streaming call's request
// headers, which are sent with its first message (or when it is closed).
func (b *Bearer) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		h, err := b.header(ctx)
		if err != nil {
			return &failedConn{StreamingClientConn: conn, err: connect.NewError(connect.CodeUnauthenticated, err)}
		}
		conn.RequestHeader().Set("Authorization", h)
		return conn
	}
}

// WrapStreamingHandler leaves a server's streaming handlers alone.
func (b *Bearer) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// failedConn is a stream whose token could not be had: it sends nothing
// and every operation returns err.
type failedConn struct {
	connect.StreamingClientConn
	err error
}

func (c *failedConn) Send(any) error       { return c.err }
func (c *failedConn) Receive(any) error    { return c.err }
func (c *failedConn) CloseRequest() error  { return nil }
func (c *failedConn) CloseResponse() error { return nil }
