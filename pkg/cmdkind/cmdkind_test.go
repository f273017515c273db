package cmdkind_test

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"math"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/leasehold/leasehold/pkg/cmdkind"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

func b64(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }

func sum(s string) string {
	h := sha256.Sum256([]byte(s))
	return hex.EncodeToString(h[:])
}

func TestParseValid(t *testing.T) {
	t.Parallel()
	cases := []struct {
		kind, payload string
		want          proto.Message
	}{
		{"exec", `{"argv":["uname","-a"]}`, &nodev1.ExecPayload{Argv: []string{"uname", "-a"}}},
		{"exec", `{"argv":["/bin/true"],"env":{"A_1":"x","_b":""},"dir":"/tmp","user":"nobody","group":"65534","stdin":"` + b64("hi") + `","timeout":"90s"}`,
			&nodev1.ExecPayload{Argv: []string{"/bin/true"}, Env: map[string]string{"A_1": "x", "_b": ""}, Dir: "/tmp", User: "nobody",
				Group: "65534", Stdin: []byte("hi"), Timeout: durationpb.New(90 * time.Second)}},
		{"exec", `{"argv":["x"],"timeout":"86400s"}`, &nodev1.ExecPayload{Argv: []string{"x"}, Timeout: durationpb.New(24 * time.Hour)}},
		{"exec", `{"argv":["x"],"user":"svc-app.1$"}`, &nodev1.ExecPayload{Argv: []string{"x"}, User: "svc-app.1$"}},
		{"script", `{"interpreter":"/bin/sh","script":"echo hi\n","args":["a"]}`,
			&nodev1.ScriptPayload{Interpreter: "/bin/sh", Script: "echo hi\n", Args: []string{"a"}}},
		{"script", `{"interpreter":"python3","script":"print(1)"}`, &nodev1.ScriptPayload{Interpreter: "python3", Script: "print(1)"}},
		{"file.put", `{"path":"/etc/motd","content":"` + b64("hello") + `","mode":420,"sha256":"` + sum("hello") + `","makeDirs":true}`,
			&nodev1.FilePutPayload{Path: "/etc/motd", Content: []byte("hello"), Mode: 0o644, Sha256: sum("hello"), MakeDirs: true}},
		{"file.put", `{"path":"/x","mode":4095}`, &nodev1.FilePutPayload{Path: "/x", Mode: 0o7777}},
		{"file.get", `{"path":"/var/log/syslog"}`, &nodev1.FileGetPayload{Path: "/var/log/syslog"}},
		{"facts", ``, &nodev1.FactsPayload{}},
		{"facts", `{}`, &nodev1.FactsPayload{}},
		{"reboot", `{}`, &nodev1.RebootPayload{}},
		{"reboot", `{"delay":"3600s","reason":"kernel update"}`, &nodev1.RebootPayload{Delay: durationpb.New(time.Hour), Reason: "kernel update"}},
		{"reboot", `{"delay":"0s"}`, &nodev1.RebootPayload{Delay: durationpb.New(0)}},
	}
	for _, c := range cases {
		t.Run(c.kind+" "+c.payload, func(t *testing.T) {
			t.Parallel()
			got, err := cmdkind.Parse(c.kind, []byte(c.payload))
			require.NoError(t, err)
			require.True(t, proto.Equal(c.want, got), "got %v", got)
		})
	}
}

func TestParseOpaqueKinds(t *testing.T) {
	t.Parallel()
	for _, k := range []string{"", "custom", "bench.echo", "Exec", "exec ", "file", "file.put2"} {
		m, err := cmdkind.Parse(k, []byte("anything \x00 at all"))
		require.NoError(t, err, k)
		require.Nil(t, m, k)
		require.False(t, cmdkind.IsTyped(k), k)
	}
	for _, k := range cmdkind.Kinds() {
		require.True(t, cmdkind.IsTyped(k), k)
	}
}

func TestParseInvalid(t *testing.T) {
	t.Parallel()
	long := "/" + strings.Repeat("a", cmdkind.MaxPathBytes)
	cases := []struct {
		name, kind, payload string
		field, text         string
	}{
		{"not json", "exec", `argv`, "payload", "payload: not valid JSON for kind exec: "},
		{"unknown field", "exec", `{"argv":["x"],"shell":true}`, "payload", `payload: not valid JSON for kind exec: `},
		{"wrong type", "exec", `{"argv":"ls"}`, "payload", "payload: not valid JSON for kind exec"},
		{"facts unknown field", "facts", `{"all":true}`, "payload", "payload: not valid JSON for kind facts"},
		{"trailing data", "facts", `{}{}`, "payload", "payload: not valid JSON for kind facts"},
		{"bad utf8", "exec", "{\"argv\":[\"\xff\"]}", "payload", "payload: not valid JSON for kind exec"},
		{"empty argv", "exec", `{}`, "payload.argv", "payload.argv: must not be empty"},
		{"empty argv list", "exec", `{"argv":[]}`, "payload.argv", "payload.argv: must not be empty"},
		{"empty argv0", "exec", `{"argv":[""]}`, "payload.argv[0]", "payload.argv[0]: must name a program"},
		{"nul argv", "exec", `{"argv":["a","b\u0000c"]}`, "payload.argv[1]", "payload.argv[1]: must not contain NUL"},
		{"env name digit", "exec", `{"argv":["x"],"env":{"1X":"y"}}`, "payload.env", `payload.env: name "1X" must match [A-Za-z_][A-Za-z0-9_]*`},
		{"env name equals", "exec", `{"argv":["x"],"env":{"A=B":"y"}}`, "payload.env", `payload.env: name "A=B" must match`},
		{"env name empty", "exec", `{"argv":["x"],"env":{"":"y"}}`, "payload.env", `payload.env: name "" must match`},
		{"env value nul", "exec", `{"argv":["x"],"env":{"A":"\u0000"}}`, `payload.env["A"]`, `payload.env["A"]: must not contain NUL`},
		{"relative dir", "exec", `{"argv":["x"],"dir":"tmp"}`, "payload.dir", `payload.dir: must be absolute`},
		{"nul dir", "exec", `{"argv":["x"],"dir":"/t\u0000"}`, "payload.dir", `payload.dir: must not contain NUL`},
		{"bad user", "exec", `{"argv":["x"],"user":"-root"}`, "payload.user", `payload.user: "-root" must be a numeric id or a name`},
		{"user with space", "exec", `{"argv":["x"],"user":"a b"}`, "payload.user", `payload.user: "a b" must be`},
		{"user too long", "exec", `{"argv":["x"],"user":"` + strings.Repeat("u", 65) + `"}`, "payload.user", `payload.user: `},
		{"uid too big", "exec", `{"argv":["x"],"user":"4294967295"}`, "payload.user", `payload.user: numeric id 4294967295 must be at most 4294967294`},
		{"uid huge", "exec", `{"argv":["x"],"user":"99999999999999999999999"}`, "payload.user", `payload.user: numeric id`},
		{"bad group", "exec", `{"argv":["x"],"group":"wheel:x"}`, "payload.group", `payload.group: "wheel:x" must be`},
		{"zero timeout", "exec", `{"argv":["x"],"timeout":"0s"}`, "payload.timeout", `payload.timeout: must be positive and at most 24h0m0s, got 0s`},
		{"negative timeout", "exec", `{"argv":["x"],"timeout":"-5s"}`, "payload.timeout", `payload.timeout: must be positive`},
		{"long timeout", "exec", `{"argv":["x"],"timeout":"86401s"}`, "payload.timeout", `payload.timeout: must be positive and at most 24h0m0s, got 24h0m1s`},
		{"no interpreter", "script", `{"script":"echo"}`, "payload.interpreter", `payload.interpreter: must not be empty`},
		{"relative interpreter", "script", `{"interpreter":"bin/sh","script":"echo"}`, "payload.interpreter", `payload.interpreter: must be an absolute path or a name`},
		{"nul interpreter", "script", `{"interpreter":"sh\u0000","script":"echo"}`, "payload.interpreter", `payload.interpreter: must not contain NUL`},
		{"no script", "script", `{"interpreter":"sh"}`, "payload.script", `payload.script: must not be empty`},
		{"nul script", "script", `{"interpreter":"sh","script":"a\u0000"}`, "payload.script", `payload.script: must not contain NUL`},
		{"nul arg", "script", `{"interpreter":"sh","script":"a","args":["\u0000"]}`, "payload.args[0]", `payload.args[0]: must not contain NUL`},
		{"script env", "script", `{"interpreter":"sh","script":"a","env":{"a-b":"x"}}`, "payload.env", `payload.env: name "a-b" must match`},
		{"script timeout", "script", `{"interpreter":"sh","script":"a","timeout":"90000s"}`, "payload.timeout", `payload.timeout: must be positive`},
		{"put no path", "file.put", `{}`, "payload.path", `payload.path: is required`},
		{"put relative", "file.put", `{"path":"etc/motd"}`, "payload.path", `payload.path: must be absolute and clean`},
		{"put dotdot", "file.put", `{"path":"/etc/../root/x"}`, "payload.path", `payload.path: must be absolute and clean`},
		{"put trailing slash", "file.put", `{"path":"/etc/"}`, "payload.path", `payload.path: must be absolute and clean`},
		{"put double slash", "file.put", `{"path":"//etc"}`, "payload.path", `payload.path: must be absolute and clean`},
		{"put root", "file.put", `{"path":"/"}`, "payload.path", `payload.path: must name a file, not /`},
		{"put nul", "file.put", `{"path":"/a\u0000b"}`, "payload.path", `payload.path: must not contain NUL`},
		{"put long path", "file.put", `{"path":"` + long + `"}`, "payload.path", `payload.path: must be at most 4096 bytes`},
		{"put mode", "file.put", `{"path":"/x","mode":4096}`, "payload.mode", `payload.mode: must be at most 07777, got 010000`},
		{"put negative mode", "file.put", `{"path":"/x","mode":-1}`, "payload", `payload: not valid JSON for kind file.put`},
		{"put sha upper", "file.put", `{"path":"/x","sha256":"` + strings.ToUpper(sum("")) + `"}`, "payload.sha256", `payload.sha256: must be 64 lowercase hex digits`},
		{"put sha short", "file.put", `{"path":"/x","sha256":"abc"}`, "payload.sha256", `payload.sha256: must be 64 lowercase hex digits`},
		{"put sha mismatch", "file.put", `{"path":"/x","content":"` + b64("a") + `","sha256":"` + sum("b") + `"}`, "payload.sha256", `payload.sha256: does not match the content (its SHA-256 is ` + sum("a") + `)`},
		{"put owner", "file.put", `{"path":"/x","owner":"a/b"}`, "payload.owner", `payload.owner: "a/b" must be`},
		{"put group", "file.put", `{"path":"/x","group":" "}`, "payload.group", `payload.group: " " must be`},
		{"put bad base64", "file.put", `{"path":"/x","content":"***"}`, "payload", `payload: not valid JSON for kind file.put`},
		{"get no path", "file.get", `{}`, "payload.path", `payload.path: is required`},
		{"get relative", "file.get", `{"path":"x"}`, "payload.path", `payload.path: must be absolute and clean`},
		{"get dot", "file.get", `{"path":"/etc/./passwd"}`, "payload.path", `payload.path: must be absolute and clean`},
		{"reboot negative", "reboot", `{"delay":"-1s"}`, "payload.delay", `payload.delay: must be in 0s..1h0m0s, got -1s`},
		{"reboot long", "reboot", `{"delay":"3601s"}`, "payload.delay", `payload.delay: must be in 0s..1h0m0s, got 1h0m1s`},
		{"reboot reason nul", "reboot", `{"reason":"\u0000"}`, "payload.reason", `payload.reason: must not contain NUL`},
		{"reboot reason long", "reboot", `{"reason":"` + strings.Repeat("r", 1001) + `"}`, "payload.reason", `payload.reason: must be at most 1000 characters`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			m, err := cmdkind.Parse(c.kind, []byte(c.payload))
			require.Error(t, err)
			require.Nil(t, m)
			fe, ok := cmdkind.AsFieldError(err)
			require.True(t, ok, "%T is not a *FieldError", err)
			require.Equal(t, c.field, fe.Field)
			require.True(t, strings.HasPrefix(err.Error(), c.text), "%q does not start with %q", err.Error(), c.text)
		})
	}
}

func TestParseContentLimit(t *testing.T) {
	t.Parallel()
	payload := func(n int) []byte {
		return []byte(`{"path":"/x","content":"` + base64.StdEncoding.EncodeToString(make([]byte, n)) + `"}`)
	}
	_, err := cmdkind.ParseWith("file.put", payload(10), cmdkind.Options{MaxContentBytes: 10})
	require.NoError(t, err)
	_, err = cmdkind.ParseWith("file.put", payload(11), cmdkind.Options{MaxContentBytes: 10})
	require.EqualError(t, err, "payload.content: must be at most 10 bytes, got 11")
	_, err = cmdkind.ParseWith("file.put", payload(11), cmdkind.Options{MaxContentBytes: -1})
	require.NoError(t, err)
	_, err = cmdkind.Parse("file.put", payload(cmdkind.MaxContentBytes+1))
	require.EqualError(t, err, "payload.content: must be at most 16777216 bytes, got 16777217")

	// SkipChecksumMatch leaves the comparison to the caller but still
	// checks the format.
	mismatch := []byte(`{"path":"/x","content":"` + b64("a") + `","sha256":"` + sum("b") + `"}`)
	m, err := cmdkind.ParseWith("file.put", mismatch, cmdkind.Options{SkipChecksumMatch: true})
	require.NoError(t, err)
	require.Equal(t, sum("b"), m.(*nodev1.FilePutPayload).GetSha256())
	_, err = cmdkind.ParseWith("file.put", []byte(`{"path":"/x","sha256":"xyz"}`), cmdkind.Options{SkipChecksumMatch: true})
	require.EqualError(t, err, "payload.sha256: must be 64 lowercase hex digits")
}

// TestParseEnvErrorStable: a map with several bad names always reports the
// same one, whatever the map's iteration order.
func TestParseEnvErrorStable(t *testing.T) {
	t.Parallel()
	payload := []byte(`{"argv":["x"],"env":{"9a":"","8b":"","7c":"","6d":""}}`)
	for range 20 {
		_, err := cmdkind.Parse("exec", payload)
		require.EqualError(t, err, `payload.env: name "6d" must match [A-Za-z_][A-Za-z0-9_]*`)
	}
}

// FuzzParse: any input either parses into a message that passes the checks
// again after a protojson round trip, or is refused with a *FieldError whose
// text starts with a payload field path; never a panic.
func FuzzParse(f *testing.F) {
	for _, s := range []string{`{"argv":["ls"]}`, `{"argv":["a\u0000"]}`, `{"interpreter":"sh","script":"x"}`,
		`{"path":"/a/../b"}`, `{"path":"/x","mode":4096}`, `{"delay":"1h"}`, `{"env":{"1":"x"},"argv":["a"]}`,
		`{"argv":["x"],"timeout":"-1s"}`, `{"argv":["x"],"user":"00000000000000000000000001"}`, "", "{", "null", "[]"} {
		for _, k := range cmdkind.Kinds() {
			f.Add(k, []byte(s))
		}
	}
	f.Fuzz(func(t *testing.T, kind string, payload []byte) {
		m, err := cmdkind.Parse(kind, payload)
		if !cmdkind.IsTyped(kind) {
			if m != nil || err != nil {
				t.Fatalf("opaque kind %q: %v, %v", kind, m, err)
			}
			return
		}
		if err != nil {
			fe, ok := cmdkind.AsFieldError(err)
			if !ok || !strings.HasPrefix(fe.Field, "payload") || !strings.HasPrefix(err.Error(), fe.Field+": ") {
				t.Fatalf("error %T %q is not a payload *FieldError", err, err)
			}
			if m != nil {
				t.Fatalf("message %v with error %v", m, err)
			}
			return
		}
		if !utf8.Valid([]byte(protojson.Format(m))) {
			t.Fatalf("message %v does not format", m)
		}
		again, err := cmdkind.Parse(kind, []byte(protojson.Format(m)))
		if err != nil || !proto.Equal(m, again) {
			t.Fatalf("round trip of %v: %v, %v", m, again, err)
		}
	})
}

// TestPayloadLimitLeavesRoomForTheEnvelope: a command carrying the largest
// payload PayloadLimit allows, with every other field at the largest the
// api accepts, still fits a message of DefaultMessageBytes, so the gateway
// can send what the api accepted.
func TestPayloadLimitLeavesRoomForTheEnvelope(t *testing.T) {
	cmd := &nodev1.Command{
		CommandId:     strings.Repeat("c", 100),
		Kind:          strings.Repeat("k", 100),
		Payload:       make([]byte, cmdkind.PayloadLimit(cmdkind.DefaultMessageBytes)),
		Deadline:      timestamppb.New(time.Date(9999, 12, 31, 23, 59, 59, 999999999, time.UTC)),
		DispatchCount: math.MaxInt32,
	}
	size := proto.Size(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Command{Command: cmd}})
	require.LessOrEqual(t, size, cmdkind.DefaultMessageBytes)
	require.Less(t, size-len(cmd.GetPayload()), cmdkind.EnvelopeBytes/4, "the envelope is a few hundred bytes: the reserve leaves headroom")
}
