package gateway

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/leasehold/leasehold/pkg/cmdkind"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// TestDefaultGatewayDeliversTheAPIsLargestPayload: with the default
// --gateway.max-message-bytes, a command whose payload is as large as the
// api's default limit (cmdkind.PayloadLimit) is deliverable, and one with a
// full message's worth of payload is not (it is failed with a reason
// naming the flag, never sent).
func TestDefaultGatewayDeliversTheAPIsLargestPayload(t *testing.T) {
	g := &Gateway{cfg: Defaults()}
	require.Equal(t, cmdkind.DefaultMessageBytes, g.cfg.MaxMessageBytes)
	cmd := func(n int) *nodev1.Command {
		return &nodev1.Command{CommandId: strings.Repeat("c", 36), Kind: strings.Repeat("k", 100), Payload: make([]byte, n),
			Deadline: timestamppb.New(time.Now().Add(time.Hour)), DispatchCount: 3}
	}
	require.Empty(t, g.undeliverableReason(cmd(cmdkind.PayloadLimit(cmdkind.DefaultMessageBytes))))
	require.Contains(t, g.undeliverableReason(cmd(cmdkind.DefaultMessageBytes)), "--gateway.max-message-bytes")
}
