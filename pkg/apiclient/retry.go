package apiclient

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"time"

	"connectrpc.com/connect"
)

// Retry is a connect.Interceptor for clients that repeats a unary call
// leasehold-api refused as busy: RESOURCE_EXHAUSTED with a Retry-After
// header, which the api sends only on refusals that pass within seconds
// (a caller over its rate limit, a node whose gateway reports overload)
// and only before it has written anything (docs/api.md, "Refusals"), so a
// repeat cannot do anything twice. A RESOURCE_EXHAUSTED without
// Retry-After (a message over the size limit, a node whose queue is full,
// a node with too many credentials) would be refused again, maybe for
// minutes, and is returned at once, as is every other code.
//
// The wait before each repeat is the refusal's Retry-After with up to a
// fifth added at random, so that callers refused together do not come
// back together. A call is repeated while its waits fit in For, counted
// from its first refusal; then the last refusal is returned. Streaming
// calls are left alone: a stream may have been half used when it is
// refused.
//
// connect-go has no retry of its own, and the general retry libraries know
// neither Retry-After in a Connect error's metadata nor which refusals
// this api promises wrote nothing, which is all there is to this type.
type Retry struct {
	// For bounds the waits of one call; zero or less turns repeats off.
	For time.Duration
	// OnWait, when set, is told of each wait before it starts: the
	// procedure, the wait and the refusal that caused it.
	OnWait func(procedure string, wait time.Duration, refusal error)

	// sleep waits d or until ctx ends; tests replace it.
	sleep func(ctx context.Context, d time.Duration) error
}

var _ connect.Interceptor = (*Retry)(nil)

// WrapUnary repeats a client's refused unary call.
func (r *Retry) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if !req.Spec().IsClient || r.For <= 0 {
			return next(ctx, req)
		}
		var waited time.Duration
		for {
			res, err := next(ctx, req)
			if connect.CodeOf(err) != connect.CodeResourceExhausted {
				return res, err
			}
			wait := retryAfter(err)
			if wait == 0 {
				return nil, err
			}
			wait += time.Duration(rand.Int64N(int64(wait)/5 + 1))
			if waited+wait > r.For {
				return nil, err
			}
			if r.OnWait != nil {
				r.OnWait(req.Spec().Procedure, wait, err)
			}
			if serr := r.wait(ctx, wait); serr != nil {
				code := connect.CodeCanceled
				if errors.Is(serr, context.DeadlineExceeded) {
					code = connect.CodeDeadlineExceeded
				}
				return nil, connect.NewError(code, serr)
			}
			waited += wait
		}
	}
}

// WrapStreamingClient leaves streaming calls alone.
func (r *Retry) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

// WrapStreamingHandler leaves a server's streaming handlers alone.
func (r *Retry) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

func (r *Retry) wait(ctx context.Context, d time.Duration) error {
	if r.sleep != nil {
		return r.sleep(ctx, d)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// retryAfter is a refusal's Retry-After in whole seconds (RFC 9110's
// delay-seconds; the api sends no dates), zero when it has none.
func retryAfter(err error) time.Duration {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return 0
	}
	n, perr := strconv.Atoi(ce.Meta().Get("Retry-After"))
	if perr != nil || n <= 0 {
		return 0
	}
	return min(time.Duration(n)*time.Second, time.Minute)
}
