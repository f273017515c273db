package apiclient_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/leasehold/leasehold/pkg/apiclient"
	"github.com/leasehold/leasehold/pkg/fleettest"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

// refusing is a ControlService whose ListNodes is refused with code until
// it has been called refusals times, with retryAfter as its Retry-After
// header when set.
type refusing struct {
	controlv1connect.UnimplementedControlServiceHandler
	code       connect.Code
	refusals   int32
	retryAfter string
	calls      atomic.Int32
}

func (s *refusing) ListNodes(context.Context, *connect.Request[controlv1.ListNodesRequest]) (*connect.Response[controlv1.ListNodesResponse], error) {
	if s.calls.Add(1) <= s.refusals {
		err := connect.NewError(s.code, nil)
		if s.retryAfter != "" {
			err.Meta().Set("Retry-After", s.retryAfter)
		}
		return nil, err
	}
	return connect.NewResponse(&controlv1.ListNodesResponse{}), nil
}

func refusingClient(t *testing.T, s *refusing, r *apiclient.Retry) (controlv1connect.ControlServiceClient, *[]time.Duration) {
	t.Helper()
	_, h := controlv1connect.NewControlServiceHandler(s)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	var waits []time.Duration
	apiclient.SetSleep(r, func(ctx context.Context, d time.Duration) error {
		waits = append(waits, d)
		return ctx.Err()
	})
	return controlv1connect.NewControlServiceClient(srv.Client(), srv.URL, connect.WithInterceptors(r)), &waits
}

func listNodes(ctx context.Context, c controlv1connect.ControlServiceClient) error {
	_, err := c.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{}))
	return err
}

// TestRetryWaitsWhatTheRefusalAsks: a refusal's Retry-After sets the
// wait (with at most a fifth added), the call is repeated while the waits
// fit in For and OnWait hears of each; past the budget the refusal is
// returned.
func TestRetryWaitsWhatTheRefusalAsks(t *testing.T) {
	s := &refusing{code: connect.CodeResourceExhausted, refusals: 2, retryAfter: "3"}
	var told []string
	r := &apiclient.Retry{For: time.Minute, OnWait: func(proc string, _ time.Duration, err error) {
		told = append(told, proc+": "+connect.CodeOf(err).String())
	}}
	c, waits := refusingClient(t, s, r)
	if err := listNodes(context.Background(), c); err != nil {
		t.Fatalf("after two refusals: %v", err)
	}
	if got := s.calls.Load(); got != 3 || len(*waits) != 2 {
		t.Fatalf("%d calls and waits %v, want 3 calls and 2 waits", got, *waits)
	}
	for i, w := range *waits {
		if w < 3*time.Second || w > 3600*time.Millisecond {
			t.Fatalf("wait %d is %s, want 3 s plus at most a fifth", i, w)
		}
	}
	if len(told) != 2 || told[0] != controlv1connect.ControlServiceListNodesProcedure+": resource_exhausted" {
		t.Fatalf("OnWait told %q", told)
	}

	s2 := &refusing{code: connect.CodeResourceExhausted, refusals: 100, retryAfter: "1"}
	c2, waits2 := refusingClient(t, s2, &apiclient.Retry{For: 2500 * time.Millisecond})
	if code := connect.CodeOf(listNodes(context.Background(), c2)); code != connect.CodeResourceExhausted {
		t.Fatalf("past the budget: code %v, want resource_exhausted", code)
	}
	if got := s2.calls.Load(); got != 3 || len(*waits2) != 2 {
		t.Fatalf("%d calls and waits %v: want 3 calls, the two waits of 1-1.2 s that fit in 2.5 s", got, *waits2)
	}
}

// TestRetryRepeatsOnlyWhatItMay: RESOURCE_EXHAUSTED without Retry-After
// (a message over the size limit) and any other code are returned at
// once; a Retry-After longer than the budget is not waited; a Retry with
// For 0 repeats nothing; a cancelled context ends the wait with CANCELED.
func TestRetryRepeatsOnlyWhatItMay(t *testing.T) {
	for _, tc := range []struct {
		name string
		s    *refusing
		r    *apiclient.Retry
		code connect.Code
	}{
		{"no Retry-After", &refusing{code: connect.CodeResourceExhausted, refusals: 5}, &apiclient.Retry{For: time.Minute}, connect.CodeResourceExhausted},
		{"unavailable", &refusing{code: connect.CodeUnavailable, refusals: 5, retryAfter: "1"}, &apiclient.Retry{For: time.Minute}, connect.CodeUnavailable},
		{"Retry-After past the budget", &refusing{code: connect.CodeResourceExhausted, refusals: 5, retryAfter: "30"}, &apiclient.Retry{For: 10 * time.Second}, connect.CodeResourceExhausted},
		{"For 0", &refusing{code: connect.CodeResourceExhausted, refusals: 5, retryAfter: "1"}, &apiclient.Retry{}, connect.CodeResourceExhausted},
	} {
		c, waits := refusingClient(t, tc.s, tc.r)
		if code := connect.CodeOf(listNodes(context.Background(), c)); code != tc.code || tc.s.calls.Load() != 1 || len(*waits) != 0 {
			t.Fatalf("%s: code %v after %d calls and waits %v, want %v after one call", tc.name, code, tc.s.calls.Load(), *waits, tc.code)
		}
	}

	ctx, cancel := context.WithCancel(context.Background())
	cs := &refusing{code: connect.CodeResourceExhausted, refusals: 5, retryAfter: "1"}
	c, _ := refusingClient(t, cs, &apiclient.Retry{For: time.Minute, OnWait: func(string, time.Duration, error) { cancel() }})
	if code := connect.CodeOf(listNodes(ctx, c)); code != connect.CodeCanceled {
		t.Fatalf("cancelled during a wait: code %v, want canceled", code)
	}
}

// TestRetryRidesThroughTheAPIsRateLimit runs a real leasehold-api whose
// rate limit lets a token make one call every two seconds: a client with
// Retry makes three calls in a row and all succeed, having waited the
// api's Retry-After twice, while a client without it is refused.
func TestRetryRidesThroughTheAPIsRateLimit(t *testing.T) {
	db := pgtest.NewDB(t)
	addr := fleettest.Addr(t)
	args := append([]string{"--database-url", db.URL, "--http-addr", fleettest.Addr(t), "--id", "api_retry", "--log-format", "text",
		"--listen-addr", addr, "--api.rate-limit", "0.5", "--api.rate-burst", "1"}, fleettest.DBFlags(db.URL)...)
	p := proctest.Start(t, "api_retry", fleettest.Binary(t, "api"), []string{"LEASEHOLD_API_TOKENS=viewer:" + viewerToken}, args...)
	p.WaitReady(60 * time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	var waits []string
	r := &apiclient.Retry{For: 20 * time.Second, OnWait: func(_ string, d time.Duration, err error) {
		waits = append(waits, d.Round(time.Second).String()+" "+err.Error())
	}}
	bearer := apiclient.NewBearer(apiclient.StaticToken(viewerToken))
	c := controlv1connect.NewControlServiceClient(http.DefaultClient, "http://"+addr, connect.WithInterceptors(r, bearer))
	for i := range 3 {
		if err := listNodes(ctx, c); err != nil {
			t.Fatalf("call %d: %v (waits %q)", i, err, waits)
		}
	}
	if len(waits) < 2 || !strings.Contains(waits[0], "--api.rate-limit") {
		t.Fatalf("waits %q: want at least two, for the rate limit", waits)
	}
	plain := controlv1connect.NewControlServiceClient(http.DefaultClient, "http://"+addr, connect.WithInterceptors(bearer))
	if code := connect.CodeOf(listNodes(ctx, plain)); code != connect.CodeResourceExhausted {
		t.Fatalf("without Retry: code %v, want resource_exhausted", code)
	}
}
