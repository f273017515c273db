package apiclient_test

import (
	"context"
	"errors"
	"net/http"
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

func TestMain(m *testing.M) { pgtest.Main(m) }

const viewerToken = "apiclient-test-viewer-token-1"

// streamCode opens StreamCommandOutput for a command that does not exist and
// returns the code the stream ended with: NOT_FOUND once the call was
// authenticated, UNAUTHENTICATED when it was not.
func streamCode(ctx context.Context, c controlv1connect.ControlServiceClient) connect.Code {
	st, err := c.StreamCommandOutput(ctx, connect.NewRequest(&controlv1.StreamCommandOutputRequest{CommandId: "no-such-command"}))
	if err != nil {
		return connect.CodeOf(err)
	}
	defer func() { _ = st.Close() }()
	for st.Receive() {
	}
	return connect.CodeOf(st.Err())
}

// TestBearerAuthenticatesStreams runs a real leasehold-api: a server stream
// (StreamCommandOutput) through Bearer gets past authentication (NOT_FOUND
// for an unknown command), while the unary-only interceptor the docs used
// to show leaves the same stream UNAUTHENTICATED, as do a wrong token and a
// TokenFunc that fails; unary calls authenticate too.
func TestBearerAuthenticatesStreams(t *testing.T) {
	db := pgtest.NewDB(t)
	addr := fleettest.Addr(t)
	args := append([]string{"--database-url", db.URL, "--http-addr", fleettest.Addr(t), "--id", "api_client", "--log-format", "text",
		"--listen-addr", addr}, fleettest.DBFlags(db.URL)...)
	p := proctest.Start(t, "api_client", fleettest.Binary(t, "api"), []string{"LEASEHOLD_API_TOKENS=viewer:" + viewerToken}, args...)
	p.WaitReady(60 * time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	client := func(opts ...connect.ClientOption) controlv1connect.ControlServiceClient {
		return controlv1connect.NewControlServiceClient(http.DefaultClient, "http://"+addr, opts...)
	}
	unaryOnly := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			req.Header().Set("Authorization", "Bearer "+viewerToken)
			return next(ctx, req)
		}
	})

	good := client(connect.WithInterceptors(apiclient.NewBearer(apiclient.StaticToken(viewerToken))))
	if code := streamCode(ctx, good); code != connect.CodeNotFound {
		t.Fatalf("stream with Bearer: code %v, want not_found", code)
	}
	if _, err := good.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{})); err != nil {
		t.Fatalf("unary call with Bearer: %v", err)
	}
	if code := streamCode(ctx, client(connect.WithInterceptors(unaryOnly))); code != connect.CodeUnauthenticated {
		t.Fatalf("stream with a unary-only interceptor: code %v, want unauthenticated", code)
	}
	wrong := client(connect.WithInterceptors(apiclient.NewBearer(apiclient.StaticToken("not-the-token-0123456789"))))
	if code := streamCode(ctx, wrong); code != connect.CodeUnauthenticated {
		t.Fatalf("stream with a wrong token: code %v, want unauthenticated", code)
	}
	failing := client(connect.WithInterceptors(apiclient.NewBearer(func(context.Context) (string, error) {
		return "", errors.New("token file unreadable")
	})))
	if code := streamCode(ctx, failing); code != connect.CodeUnauthenticated {
		t.Fatalf("stream whose TokenFunc fails: code %v, want unauthenticated", code)
	}
	_, err := failing.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{}))
	if connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Fatalf("unary call whose TokenFunc fails: %v, want unauthenticated", err)
	}
}
