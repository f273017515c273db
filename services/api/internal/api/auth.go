package api

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"connectrpc.com/connect"

	"github.com/leasehold/leasehold/pkg/apiauth"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
)

// requiredRoles is the role matrix (docs/api.md): viewers read, operators
// also run commands and pool leases, admins also change nodes, pools and
// sinks. A procedure missing here needs admin (deny by default); a test
// checks that every ControlService method is listed.
var requiredRoles = map[string]apiauth.Role{
	controlv1connect.ControlServiceGetNodeProcedure:        apiauth.RoleViewer,
	controlv1connect.ControlServiceListNodesProcedure:      apiauth.RoleViewer,
	controlv1connect.ControlServiceGetCommandProcedure:     apiauth.RoleViewer,
	controlv1connect.ControlServiceListCommandsProcedure:   apiauth.RoleViewer,
	controlv1connect.ControlServiceWaitCommandProcedure:    apiauth.RoleViewer,
	controlv1connect.ControlServiceGetPoolProcedure:        apiauth.RoleViewer,
	controlv1connect.ControlServiceListPoolsProcedure:      apiauth.RoleViewer,
	controlv1connect.ControlServiceGetPoolLeaseProcedure:   apiauth.RoleViewer,
	controlv1connect.ControlServiceListPoolLeasesProcedure: apiauth.RoleViewer,
	controlv1connect.ControlServiceListSinksProcedure:      apiauth.RoleViewer,
	controlv1connect.ControlServiceListLeasesProcedure:     apiauth.RoleViewer,
	controlv1connect.ControlServiceListWorkersProcedure:    apiauth.RoleViewer,
	controlv1connect.ControlServiceListGatewaysProcedure:   apiauth.RoleViewer,
	// Live output.
	controlv1connect.ControlServiceStreamCommandOutputProcedure: apiauth.RoleViewer,
	// Runs: reads for viewers, changes for operators.
	controlv1connect.ControlServiceGetRunProcedure:         apiauth.RoleViewer,
	controlv1connect.ControlServiceListRunsProcedure:       apiauth.RoleViewer,
	controlv1connect.ControlServiceWaitRunProcedure:        apiauth.RoleViewer,
	controlv1connect.ControlServiceStreamRunNodesProcedure: apiauth.RoleViewer,

	controlv1connect.ControlServiceCreateCommandProcedure:    apiauth.RoleOperator,
	controlv1connect.ControlServiceCancelCommandProcedure:    apiauth.RoleOperator,
	controlv1connect.ControlServiceCreatePoolLeaseProcedure:  apiauth.RoleOperator,
	controlv1connect.ControlServiceReleasePoolLeaseProcedure: apiauth.RoleOperator,
	controlv1connect.ControlServiceCreateRunProcedure:        apiauth.RoleOperator,
	controlv1connect.ControlServiceCancelRunProcedure:        apiauth.RoleOperator,

	controlv1connect.ControlServiceRegisterNodeProcedure: apiauth.RoleAdmin,
	controlv1connect.ControlServiceRevokeNodeProcedure:   apiauth.RoleAdmin,
	controlv1connect.ControlServiceCreatePoolProcedure:   apiauth.RoleAdmin,
	controlv1connect.ControlServiceCreateSinkProcedure:   apiauth.RoleAdmin,
	controlv1connect.ControlServiceDeleteSinkProcedure:   apiauth.RoleAdmin,

	// Node lifecycle and the audit trail.
	controlv1connect.ControlServiceCordonNodeProcedure:       apiauth.RoleAdmin,
	controlv1connect.ControlServiceUncordonNodeProcedure:     apiauth.RoleAdmin,
	controlv1connect.ControlServiceDrainNodeProcedure:        apiauth.RoleAdmin,
	controlv1connect.ControlServiceDecommissionNodeProcedure: apiauth.RoleAdmin,
	controlv1connect.ControlServiceListAuditEventsProcedure:  apiauth.RoleAdmin,

	// Enrollment: join tokens and re-enrolment. EnrollmentService itself
	// takes no bearer token (authfirst.go) and is not listed here.
	controlv1connect.ControlServiceCreateJoinTokenProcedure: apiauth.RoleAdmin,
	controlv1connect.ControlServiceListJoinTokensProcedure:  apiauth.RoleAdmin,
	controlv1connect.ControlServiceRevokeJoinTokenProcedure: apiauth.RoleAdmin,
	controlv1connect.ControlServiceAllowReenrollProcedure:   apiauth.RoleAdmin,

	// Interactive tunnels: a role of their own, above operator.
	controlv1connect.ControlServiceOpenTunnelProcedure: apiauth.RoleTunnel,
}

// RequiredRole is the least role allowed to call procedure.
func RequiredRole(procedure string) apiauth.Role {
	if r, ok := requiredRoles[procedure]; ok {
		return r
	}
	return apiauth.RoleAdmin
}

type identityKey struct{}

// IdentityFrom returns the authenticated caller of a request's context.
func IdentityFrom(ctx context.Context) (apiauth.Identity, bool) {
	id, ok := ctx.Value(identityKey{}).(apiauth.Identity)
	return id, ok
}

var (
	errNoToken  = errors.New("missing bearer token: send Authorization: Bearer <token>")
	errBadToken = errors.New("bearer token not accepted")
)

// authInterceptor authenticates the bearer token of every call and checks
// the caller's role against the procedure: no or an unknown token is
// UNAUTHENTICATED, a known token with too small a role PERMISSION_DENIED.
type authInterceptor struct {
	keys interface {
		Authenticate(token string) (apiauth.Identity, bool)
	}
	log *slog.Logger
}

func (a *authInterceptor) authorize(ctx context.Context, procedure, header, peer string) (context.Context, error) {
	token, ok := apiauth.BearerToken(header)
	if !ok {
		return nil, unauthenticated(errNoToken)
	}
	id, ok := a.keys.Authenticate(token)
	if !ok {
		a.log.WarnContext(ctx, "api token refused", "procedure", procedure, "peer", peer)
		return nil, unauthenticated(errBadToken)
	}
	if need := RequiredRole(procedure); !id.Role.Allows(need) {
		a.log.WarnContext(ctx, "api call denied", "procedure", procedure, "caller", id.ID, "role", id.Role.String(), "needs", need.String())
		return nil, connect.NewError(connect.CodePermissionDenied, fmt.Errorf("role %s may not call %s: it needs %s", id.Role, procedure, need))
	}
	return context.WithValue(ctx, identityKey{}, id), nil
}

func unauthenticated(err error) error {
	ce := connect.NewError(connect.CodeUnauthenticated, err)
	ce.Meta().Set("WWW-Authenticate", `Bearer realm="leasehold"`)
	return ce
}

func (a *authInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if req.Spec().IsClient {
			return next(ctx, req)
		}
		ctx, err := a.authorize(ctx, req.Spec().Procedure, req.Header().Get("Authorization"), req.Peer().Addr)
		if err != nil {
			return nil, err
		}
		return next(ctx, req)
	}
}

func (a *authInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (a *authInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		ctx, err := a.authorize(ctx, conn.Spec().Procedure, conn.RequestHeader().Get("Authorization"), conn.Peer().Addr)
		if err != nil {
			return err
		}
		return next(ctx, conn)
	}
}
