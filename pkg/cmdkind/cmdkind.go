// Package cmdkind owns what the payload of a typed command kind is: the
// protobuf JSON (protojson) of that kind's message in
// proto/leasehold/node/v1/kinds.proto, with unknown fields refused. The api
// parses a payload here at CreateCommand so a bad one is refused before
// anything is written, and leasehold-node parses it again before it
// executes, so both sides agree on one definition of "valid".
//
// Everything that can be known without the node is checked here: argv
// non-empty, no NUL in argv, env, script or paths, environment names,
// absolute directories, absolute clean file paths, user and group syntax,
// timeouts, modes, checksums, content size and reboot delays. What only the
// node can know (whether a user exists, whether a path is inside its allowed
// roots) is the node's to refuse.
package cmdkind

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// The typed kinds. Any other kind is opaque: Parse returns (nil, nil) and a
// custom daemon.Handler interprets its payload.
const (
	Exec    = "exec"
	Script  = "script"
	FilePut = "file.put"
	FileGet = "file.get"
	Facts   = "facts"
	Reboot  = "reboot"
)

// Limits of the checks. MaxTimeout and MaxRebootDelay bound durations;
// MaxContentBytes is the default bound of file.put content (the node's
// --file.max-bytes default); MaxPathBytes is Linux's PATH_MAX.
const (
	MaxTimeout      = 24 * time.Hour
	MaxRebootDelay  = time.Hour
	MaxContentBytes = 16 << 20
	MaxPathBytes    = 4096
	MaxMode         = 0o7777
	maxReasonChars  = 1000
	maxNameLen      = 64
	maxNumericID    = 1<<32 - 2 // (uid_t)-1 means "unchanged" to the kernel
)

var (
	envNameRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	// nameRE is a user or group name as shadow-utils and systemd accept
	// it (a trailing $ is a Samba machine account); a name of digits only
	// is taken as a numeric id.
	nameRE   = regexp.MustCompile(`^[A-Za-z0-9_.][A-Za-z0-9_.-]*\$?$`)
	sha256RE = regexp.MustCompile(`^[0-9a-f]{64}$`)
)

// Kinds lists the typed kinds in a stable order.
func Kinds() []string { return []string{Exec, Script, FilePut, FileGet, Facts, Reboot} }

// IsTyped reports whether kind is one of the typed kinds.
func IsTyped(kind string) bool { return slices.Contains(Kinds(), kind) }

// FieldError is a refused payload: Field is the path of the offending field
// from the request's point of view ("payload.argv[0]", "payload.env"), and
// Reason says what is wrong. Its text is "<Field>: <Reason>", so it can be
// returned to an operator as it is.
type FieldError struct {
	Field  string
	Reason string
}

// Error returns "<Field>: <Reason>".
func (e *FieldError) Error() string { return e.Field + ": " + e.Reason }

func fieldErr(field, format string, args ...any) error {
	return &FieldError{Field: field, Reason: fmt.Sprintf(format, args...)}
}

// Options tune Parse for a caller with other limits than the defaults.
type Options struct {
	// MaxContentBytes bounds file.put content; 0 means MaxContentBytes, a
	// negative value means no bound (a caller that checks the size itself,
	// as the node does to report file_too_large).
	MaxContentBytes int64
	// SkipChecksumMatch leaves the comparison of file.put's sha256 with its
	// content to the caller (the node compares it with the bytes it wrote);
	// the sha256's format is still checked.
	SkipChecksumMatch bool
}

// Parse is ParseWith with the default Options.
func Parse(kind string, payload []byte) (proto.Message, error) {
	return ParseWith(kind, payload, Options{})
}

// ParseWith returns the validated payload message of a typed kind
// (*nodev1.ExecPayload, *nodev1.ScriptPayload, *nodev1.FilePutPayload,
// *nodev1.FileGetPayload, *nodev1.FactsPayload or *nodev1.RebootPayload),
// and (nil, nil) for any other kind, whose payload is opaque. An empty
// payload is read as {}. Every error is a *FieldError.
func ParseWith(kind string, payload []byte, o Options) (proto.Message, error) {
	var m proto.Message
	switch kind {
	case Exec:
		m = &nodev1.ExecPayload{}
	case Script:
		m = &nodev1.ScriptPayload{}
	case FilePut:
		m = &nodev1.FilePutPayload{}
	case FileGet:
		m = &nodev1.FileGetPayload{}
	case Facts:
		m = &nodev1.FactsPayload{}
	case Reboot:
		m = &nodev1.RebootPayload{}
	default:
		return nil, nil
	}
	if len(payload) == 0 {
		payload = []byte("{}")
	}
	if err := (protojson.UnmarshalOptions{DiscardUnknown: false}).Unmarshal(payload, m); err != nil {
		return nil, fieldErr("payload", "not valid JSON for kind %s: %s", kind, strings.TrimPrefix(err.Error(), "proto: "))
	}
	var err error
	switch p := m.(type) {
	case *nodev1.ExecPayload:
		err = checkExec(p)
	case *nodev1.ScriptPayload:
		err = checkScript(p)
	case *nodev1.FilePutPayload:
		err = checkFilePut(p, o)
	case *nodev1.FileGetPayload:
		err = CheckFilePath("payload.path", p.GetPath())
	case *nodev1.RebootPayload:
		err = checkReboot(p)
	}
	if err != nil {
		return nil, err
	}
	return m, nil
}

func checkExec(p *nodev1.ExecPayload) error {
	if len(p.GetArgv()) == 0 {
		return fieldErr("payload.argv", "must not be empty")
	}
	if p.GetArgv()[0] == "" {
		return fieldErr("payload.argv[0]", "must name a program")
	}
	if err := checkStrings("payload.argv", p.GetArgv()); err != nil {
		return err
	}
	return checkRun(p.GetEnv(), p.GetDir(), p.GetUser(), p.GetGroup(), p.GetTimeout())
}

func checkScript(p *nodev1.ScriptPayload) error {
	if p.GetInterpreter() == "" {
		return fieldErr("payload.interpreter", "must not be empty")
	}
	if strings.ContainsRune(p.GetInterpreter(), 0) {
		return fieldErr("payload.interpreter", "must not contain NUL")
	}
	if strings.Contains(p.GetInterpreter(), "/") && !filepath.IsAbs(p.GetInterpreter()) {
		return fieldErr("payload.interpreter", "must be an absolute path or a name looked up in PATH, got %q", abbrev(p.GetInterpreter()))
	}
	if p.GetScript() == "" {
		return fieldErr("payload.script", "must not be empty")
	}
	if strings.ContainsRune(p.GetScript(), 0) {
		return fieldErr("payload.script", "must not contain NUL")
	}
	if err := checkStrings("payload.args", p.GetArgs()); err != nil {
		return err
	}
	return checkRun(p.GetEnv(), p.GetDir(), p.GetUser(), p.GetGroup(), p.GetTimeout())
}

// checkRun checks the fields exec and script share.
func checkRun(env map[string]string, dir, user, group string, timeout *durationpb.Duration) error {
	if err := CheckEnv("payload.env", env); err != nil {
		return err
	}
	if dir != "" {
		if strings.ContainsRune(dir, 0) {
			return fieldErr("payload.dir", "must not contain NUL")
		}
		if !filepath.IsAbs(dir) {
			return fieldErr("payload.dir", "must be absolute, got %q", abbrev(dir))
		}
		if len(dir) > MaxPathBytes {
			return fieldErr("payload.dir", "must be at most %d bytes", MaxPathBytes)
		}
	}
	if err := CheckUserOrGroup("payload.user", user); err != nil {
		return err
	}
	if err := CheckUserOrGroup("payload.group", group); err != nil {
		return err
	}
	if timeout != nil {
		if err := timeout.CheckValid(); err != nil {
			return fieldErr("payload.timeout", "is not a valid duration")
		}
		if d := timeout.AsDuration(); d <= 0 || d > MaxTimeout {
			return fieldErr("payload.timeout", "must be positive and at most %s, got %s", MaxTimeout, d)
		}
	}
	return nil
}

func checkFilePut(p *nodev1.FilePutPayload, o Options) error {
	if err := CheckFilePath("payload.path", p.GetPath()); err != nil {
		return err
	}
	limit := o.MaxContentBytes
	if limit == 0 {
		limit = MaxContentBytes
	}
	if limit > 0 && int64(len(p.GetContent())) > limit {
		return fieldErr("payload.content", "must be at most %d bytes, got %d", limit, len(p.GetContent()))
	}
	if p.GetMode() > MaxMode {
		return fieldErr("payload.mode", "must be at most 07777, got %#o", p.GetMode())
	}
	if err := CheckUserOrGroup("payload.owner", p.GetOwner()); err != nil {
		return err
	}
	if err := CheckUserOrGroup("payload.group", p.GetGroup()); err != nil {
		return err
	}
	if s := p.GetSha256(); s != "" {
		if !sha256RE.MatchString(s) {
			return fieldErr("payload.sha256", "must be 64 lowercase hex digits")
		}
		if !o.SkipChecksumMatch {
			if sum := sha256.Sum256(p.GetContent()); hex.EncodeToString(sum[:]) != s {
				return fieldErr("payload.sha256", "does not match the content (its SHA-256 is %x)", sum)
			}
		}
	}
	return nil
}

func checkReboot(p *nodev1.RebootPayload) error {
	if d := p.GetDelay(); d != nil {
		if err := d.CheckValid(); err != nil {
			return fieldErr("payload.delay", "is not a valid duration")
		}
		if v := d.AsDuration(); v < 0 || v > MaxRebootDelay {
			return fieldErr("payload.delay", "must be in 0s..%s, got %s", MaxRebootDelay, v)
		}
	}
	if strings.ContainsRune(p.GetReason(), 0) {
		return fieldErr("payload.reason", "must not contain NUL")
	}
	if n := utf8.RuneCountInString(p.GetReason()); n > maxReasonChars {
		return fieldErr("payload.reason", "must be at most %d characters, got %d", maxReasonChars, n)
	}
	return nil
}

func checkStrings(field string, vs []string) error {
	for i, v := range vs {
		if strings.ContainsRune(v, 0) {
			return fieldErr(fmt.Sprintf("%s[%d]", field, i), "must not contain NUL")
		}
	}
	return nil
}

// CheckEnv checks environment variables: names match
// [A-Za-z_][A-Za-z0-9_]*, values have no NUL. Names are checked in sorted
// order so the same map always gets the same error.
func CheckEnv(field string, env map[string]string) error {
	names := make([]string, 0, len(env))
	for k := range env {
		names = append(names, k)
	}
	slices.Sort(names)
	for _, k := range names {
		if !envNameRE.MatchString(k) {
			return fieldErr(field, "name %q must match %s", abbrev(k), envNameRE.String()[1:len(envNameRE.String())-1])
		}
		if strings.ContainsRune(env[k], 0) {
			return fieldErr(fmt.Sprintf("%s[%q]", field, k), "must not contain NUL")
		}
	}
	return nil
}

// CheckFilePath checks a file path: non-empty, absolute, clean (as
// filepath.Clean leaves it, so no "..", "//" or trailing slash), not the
// root itself, without NUL and at most MaxPathBytes.
func CheckFilePath(field, p string) error {
	switch {
	case p == "":
		return fieldErr(field, "is required")
	case strings.ContainsRune(p, 0):
		return fieldErr(field, "must not contain NUL")
	case len(p) > MaxPathBytes:
		return fieldErr(field, "must be at most %d bytes", MaxPathBytes)
	case !filepath.IsAbs(p) || filepath.Clean(p) != p:
		return fieldErr(field, "must be absolute and clean, got %q", abbrev(p))
	case p == "/":
		return fieldErr(field, "must name a file, not /")
	}
	return nil
}

// CheckUserOrGroup checks a user or group reference: empty (not set), a
// numeric id (0..4294967294), or a name of letters, digits, '_', '.', '-'
// (not starting with '-'), at most 64 bytes, optionally ending in '$'.
func CheckUserOrGroup(field, v string) error {
	if v == "" {
		return nil
	}
	if IsNumericID(v) {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil || n > maxNumericID {
			return fieldErr(field, "numeric id %s must be at most %d", abbrev(v), uint64(maxNumericID))
		}
		return nil
	}
	if len(v) > maxNameLen || !nameRE.MatchString(v) {
		return fieldErr(field, "%q must be a numeric id or a name of letters, digits, '_', '.', '-' (at most %d bytes, not starting with '-')", abbrev(v), maxNameLen)
	}
	return nil
}

// IsNumericID reports whether v is all ASCII digits (and not empty): such a
// user or group is looked up by id, not by name.
func IsNumericID(v string) bool {
	return v != "" && strings.Trim(v, "0123456789") == ""
}

// AsFieldError returns err's *FieldError, if it has one.
func AsFieldError(err error) (*FieldError, bool) {
	var fe *FieldError
	ok := errors.As(err, &fe)
	return fe, ok
}

func abbrev(s string) string {
	if len(s) <= 60 {
		return s
	}
	return strings.ToValidUTF8(s[:60], "") + "…"
}

// DefaultMessageBytes is the default largest message a gateway sends a node
// (--gateway.max-message-bytes). The api's default payload limit is derived
// from it, so a payload the api accepts fits the message a default gateway
// sends.
const DefaultMessageBytes = 1 << 20

// EnvelopeBytes bounds what a command's message adds to its payload: the
// command id and kind (at most 100 bytes each as the api accepts them),
// deadline, dispatch count and the ConnectResponse framing take a few
// hundred bytes; the rest is headroom for fields added later.
const EnvelopeBytes = 4 << 10

// PayloadLimit is the largest payload a command message of at most
// messageBytes carries.
func PayloadLimit(messageBytes int) int { return messageBytes - EnvelopeBytes }
