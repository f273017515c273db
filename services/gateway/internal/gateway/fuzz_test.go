package gateway

import (
	"bytes"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/nodeauth"
)

// FuzzConnectRequest: any bytes from a node decode into a ConnectRequest
// (what the gateway reads) without panicking, a decoded message survives a
// deterministic round trip, and validateHello never panics, accepts only
// what its limits allow and never echoes the credential in its error.
func FuzzConnectRequest(f *testing.F) {
	for _, m := range []*nodev1.ConnectRequest{
		{Msg: &nodev1.ConnectRequest_Hello{Hello: &nodev1.Hello{NodeId: "node-1", Credential: "lhn_secret", DaemonVersion: "1.0",
			Kind: nodev1.NodeKind_NODE_KIND_NODE, InFlightCommandIds: []string{"c1"}, Labels: map[string]string{"zone": "a"}, SiteId: "s1"}}},
		{Msg: &nodev1.ConnectRequest_Hello{Hello: &nodev1.Hello{NodeId: "agent-1", Credential: "x", Kind: nodev1.NodeKind_NODE_KIND_SITE_AGENT}}},
		{Msg: &nodev1.ConnectRequest_Hello{Hello: &nodev1.Hello{NodeId: "bad id", Credential: "lhn_secret"}}},
		{Msg: &nodev1.ConnectRequest_Heartbeat{Heartbeat: &nodev1.Heartbeat{Sequence: 1}}},
		{Msg: &nodev1.ConnectRequest_CommandAck{CommandAck: &nodev1.CommandAck{CommandId: "c1"}}},
		{Msg: &nodev1.ConnectRequest_CommandResult{CommandResult: &nodev1.CommandResult{CommandId: "c1", ResultId: "r1", ExitCode: 1, Output: []byte("x")}}},
		{Msg: &nodev1.ConnectRequest_Event{Event: &nodev1.Event{EventId: "e1", Kind: "k", BootEpoch: 2}}},
		{},
	} {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Fuzz(func(t *testing.T, b []byte) {
		var m nodev1.ConnectRequest
		if err := proto.Unmarshal(b, &m); err != nil {
			return
		}
		opts := proto.MarshalOptions{Deterministic: true}
		b1, err := opts.Marshal(&m)
		if err != nil {
			t.Fatalf("re-marshal: %v", err)
		}
		var m2 nodev1.ConnectRequest
		if err := proto.Unmarshal(b1, &m2); err != nil {
			t.Fatalf("decode of re-encoded message: %v", err)
		}
		if b2, _ := opts.Marshal(&m2); !bytes.Equal(b1, b2) {
			t.Fatalf("round trip changed the message")
		}
		h := m.GetHello()
		if h == nil {
			return
		}
		err = validateHello(h)
		if err == nil {
			if nodeauth.ValidateNodeID(h.GetNodeId()) != nil || len(h.GetCredential()) == 0 || len(h.GetCredential()) > maxCredentialSz ||
				h.GetKind() == nodev1.NodeKind_NODE_KIND_UNSPECIFIED || len(h.GetInFlightCommandIds()) > maxInFlightIDs {
				t.Fatalf("validateHello accepted %v", h)
			}
			return
		}
		if c := h.GetCredential(); len(c) >= 4 && strings.Contains(err.Error(), c) {
			t.Fatalf("validateHello's error echoes the credential: %v", err)
		}
	})
}
