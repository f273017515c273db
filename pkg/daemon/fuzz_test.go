package daemon_test

import (
	"bytes"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// NodeMessages are one example of every message of the node stream, both
// directions, for fuzz seeds here and in the gateway.
func nodeMessages() []proto.Message {
	payload, _ := structpb.NewStruct(map[string]any{"mac": "52:54:00:12:34:56", "n": 1.5, "ok": true, "l": []any{"a", 2.0}})
	ts := timestamppb.New(time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC))
	return []proto.Message{
		&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Hello{Hello: &nodev1.Hello{NodeId: "node-1", Credential: "lhn_secret", DaemonVersion: "1.0", InFlightCommandIds: []string{"c1", "c2"}}}},
		&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Heartbeat{Heartbeat: &nodev1.Heartbeat{Sequence: 7}}},
		&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandAck{CommandAck: &nodev1.CommandAck{CommandId: "c1"}}},
		&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandResult{CommandResult: &nodev1.CommandResult{CommandId: "c1", ResultId: "r1", ExitCode: 3, Output: []byte("out\x00"), Error: "boom", StartedAt: ts, FinishedAt: ts}}},
		&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Event{Event: &nodev1.Event{EventId: "e1", Kind: "site.discovery", Payload: payload, OccurredAt: ts, BootEpoch: 4}}},
		&nodev1.ConnectRequest{},
		&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Welcome{Welcome: &nodev1.Welcome{SessionEpoch: 9, GatewayId: "gw_1", HeartbeatInterval: durationpb.New(10 * time.Second),
			Spec: &nodev1.NodeSpec{Labels: map[string]string{"zone": "a"}, DesiredState: "ready", SiteBoot: &nodev1.SiteBoot{Active: true, Epoch: 3}, Attributes: map[string]string{"k": "v"}}}}},
		&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Command{Command: &nodev1.Command{CommandId: "c1", Kind: "exec", Payload: []byte{1, 2, 3}, Deadline: ts, DispatchCount: 2}}},
		&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_NodeSpecUpdate{NodeSpecUpdate: &nodev1.NodeSpecUpdate{Spec: &nodev1.NodeSpec{DesiredState: "drained"}}}},
		&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Drain{Drain: &nodev1.Drain{Delay: durationpb.New(time.Second), Reason: "shutdown"}}},
		&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Pushback{Pushback: &nodev1.Pushback{RetryAfter: durationpb.New(2 * time.Second), Reason: "busy"}}},
		&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_HeartbeatAck{HeartbeatAck: &nodev1.HeartbeatAck{Sequence: 7}}},
		&nodev1.ConnectResponse{},
	}
}

func addSeeds(f *testing.F) {
	for _, m := range nodeMessages() {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{})
	f.Add([]byte{0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f}) // a length far past the end
	f.Add([]byte{0x0a, 0x02, 0x0a, 0x80})             // truncated varint inside a submessage
}

// roundTrip unmarshals b into a fresh m; when it decodes, the deterministic
// encoding must decode again to the same deterministic encoding.
func roundTrip(t *testing.T, b []byte, fresh func() proto.Message) {
	m := fresh()
	if err := proto.Unmarshal(b, m); err != nil {
		return // refused cleanly
	}
	opts := proto.MarshalOptions{Deterministic: true}
	b1, err := opts.Marshal(m)
	if err != nil {
		t.Fatalf("re-marshal of a decoded message: %v", err)
	}
	m2 := fresh()
	if err := proto.Unmarshal(b1, m2); err != nil {
		t.Fatalf("decode of a re-encoded message: %v", err)
	}
	b2, err := opts.Marshal(m2)
	if err != nil {
		t.Fatalf("re-marshal: %v", err)
	}
	if !bytes.Equal(b1, b2) {
		t.Fatalf("round trip changed the message:\n%x\n%x", b1, b2)
	}
}

// FuzzConnectResponse: any bytes from a gateway decode into a
// ConnectResponse (what the daemon reads) without panicking, and a decoded
// message survives a round trip. (FuzzConnectRequest in the gateway covers
// the other direction.)
func FuzzConnectResponse(f *testing.F) {
	addSeeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		roundTrip(t, b, func() proto.Message { return &nodev1.ConnectResponse{} })
		// Every accessor of every oneof case is safe on what decoded.
		var m nodev1.ConnectResponse
		if proto.Unmarshal(b, &m) == nil {
			_ = m.GetWelcome().GetSpec().GetSiteBoot().GetEpoch()
			_ = m.GetCommand().GetDeadline().AsTime()
			_ = m.GetDrain().GetDelay().AsDuration()
			_ = m.GetPushback().GetRetryAfter().AsDuration()
			_ = m.GetWelcome().GetHeartbeatInterval().AsDuration()
			_ = m.GetNodeSpecUpdate().GetSpec().GetLabels()
			_ = m.GetHeartbeatAck().GetSequence()
		}
	})
}
