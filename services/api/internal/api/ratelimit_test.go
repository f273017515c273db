package api

import (
	"context"
	"net/http"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	enrollv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/enroll/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/enroll/v1/enrollv1connect"
)

// TestRateLimitPerToken: a token over its rate is refused
// RESOURCE_EXHAUSTED with Retry-After, naming the flag, before its call
// runs; another token's calls go on; enrollment callers, who carry no
// token, are limited per source address.
func TestRateLimitPerToken(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *Config, _ *http.Transport) { c.RateLimit, c.RateBurst = 0.001, 3 })
	ctx := context.Background()
	op, viewer := b.client(operatorToken), b.client(viewerToken)
	for range 3 {
		_, err := op.ListWorkers(ctx, connect.NewRequest(&controlv1.ListWorkersRequest{}))
		require.NoError(t, err)
	}
	_, err := op.ListWorkers(ctx, connect.NewRequest(&controlv1.ListWorkersRequest{}))
	require.Equal(t, connect.CodeResourceExhausted, connect.CodeOf(err))
	require.ErrorContains(t, err, "--api.rate-limit")
	var ce *connect.Error
	require.ErrorAs(t, err, &ce)
	require.NotEmpty(t, ce.Meta().Get("Retry-After"))
	require.NotContains(t, err.Error(), operatorToken, "the refusal never shows the token")

	_, err = viewer.ListWorkers(ctx, connect.NewRequest(&controlv1.ListWorkersRequest{}))
	require.NoError(t, err, "another token has its own bucket")

	enroll := enrollv1connect.NewEnrollmentServiceClient(b.http, b.base)
	var codes []connect.Code
	for range 4 {
		_, err := enroll.Join(ctx, connect.NewRequest(&enrollv1.JoinRequest{Token: "lhj_0000000000000000.x", NodeId: "n-1"}))
		codes = append(codes, connect.CodeOf(err))
	}
	require.Equal(t, []connect.Code{connect.CodeUnauthenticated, connect.CodeUnauthenticated, connect.CodeUnauthenticated, connect.CodeResourceExhausted}, codes,
		"a source guessing join tokens is slowed down")
}
