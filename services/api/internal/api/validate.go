package api

import (
	"encoding/base64"
	"fmt"
	"net/url"
	"regexp"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/leasehold/leasehold/pkg/cmdkind"
	"github.com/leasehold/leasehold/pkg/egress"
)

// Every request field is checked here before any SQL runs; a failure is
// INVALID_ARGUMENT with a message that starts with the field's name. The
// patterns repeat the tables' CHECK constraints so nothing invalid reaches
// the database.
var (
	// idRE: node, pool, command and pool lease ids, tenants, site ids.
	idRE = regexp.MustCompile(`^[A-Za-z0-9._:@-]{1,200}$`)
	// sinkIDRE: sink ids (they name leases singleton:sink:<id>).
	sinkIDRE = regexp.MustCompile(`^[A-Za-z0-9._-]{1,100}$`)
	// kindRE: command kinds.
	kindRE = regexp.MustCompile(`^[A-Za-z0-9._:/-]{1,100}$`)
	// idempotencyKeyRE: printable ASCII without spaces.
	idempotencyKeyRE = regexp.MustCompile(`^[\x21-\x7e]{1,200}$`)
	// labelKeyRE: label and selector keys.
	labelKeyRE = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._/:-]{0,126}[A-Za-z0-9])?$`)
	// leasePrefixRE: a prefix of a lease name (docs/design.md#leases).
	leasePrefixRE = regexp.MustCompile(`^[A-Za-z0-9._:@/-]{0,200}$`)
	// groupRE: a membership group.
	groupRE = regexp.MustCompile(`^[A-Za-z0-9._-]{0,100}$`)
)

// Request limits.
const (
	maxLabels        = 64
	maxLabelValueLen = 256
	// maxPayloadBytes is cmdkind.PayloadLimit(cmdkind.DefaultMessageBytes):
	// what a default gateway's message carries.
	maxPayloadBytes   = cmdkind.DefaultMessageBytes - cmdkind.EnvelopeBytes
	maxDescription    = 1000 // characters, as the pools CHECK counts
	maxURLLen         = 2000
	minSecretLen      = 16
	maxSecretLen      = 500
	maxPageSize       = 1000
	defaultPageSize   = 100
	maxPageTokenLen   = 1024
	maxPoolLeaseCount = 10000
)

func invalid(field, format string, args ...any) error {
	return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...)))
}

func checkRE(field, v string, re *regexp.Regexp) error {
	if !re.MatchString(v) {
		if v == "" {
			return invalid(field, "is required and must match %s", re)
		}
		return invalid(field, "must match %s", re)
	}
	return nil
}

// checkOptionalRE allows "" (a filter that is not set).
func checkOptionalRE(field, v string, re *regexp.Regexp) error {
	if v == "" {
		return nil
	}
	return checkRE(field, v, re)
}

// checkText checks free text: valid UTF-8, no control characters other
// than tab and newline, at most maxChars characters.
func checkText(field, v string, maxChars int) error {
	if !utf8.ValidString(v) {
		return invalid(field, "must be valid UTF-8")
	}
	if n := utf8.RuneCountInString(v); n > maxChars {
		return invalid(field, "must be at most %d characters, got %d", maxChars, n)
	}
	if strings.ContainsFunc(v, func(r rune) bool { return unicode.IsControl(r) && r != '\n' && r != '\t' }) {
		return invalid(field, "must not contain control characters")
	}
	return nil
}

func checkLabels(field string, labels map[string]string) error {
	if len(labels) > maxLabels {
		return invalid(field, "has %d entries, more than %d", len(labels), maxLabels)
	}
	for k, v := range labels {
		if !labelKeyRE.MatchString(k) {
			return invalid(field, "key %q must match %s", abbrev(k), labelKeyRE)
		}
		if len(v) > maxLabelValueLen {
			return invalid(field+"["+k+"]", "must be at most %d bytes", maxLabelValueLen)
		}
		if err := checkText(field+"["+k+"]", v, maxLabelValueLen); err != nil {
			return err
		}
		if strings.ContainsAny(v, "\n\t") {
			return invalid(field+"["+k+"]", "must not contain control characters")
		}
	}
	return nil
}

func checkPage(size int32, token string) error {
	if size < 0 || size > maxPageSize {
		return invalid("page_size", "must be in 0..%d (0 means %d), got %d", maxPageSize, defaultPageSize, size)
	}
	if len(token) > maxPageTokenLen {
		return invalid("page_token", "is not a page token of this call")
	}
	return nil
}

func pageSize(size int32) int {
	if size == 0 {
		return defaultPageSize
	}
	return int(size)
}

func checkEnum[E ~int32](field string, v E, names map[int32]string, allowUnspecified bool) error {
	if _, ok := names[int32(v)]; !ok || (!allowUnspecified && v == 0) {
		return invalid(field, "%d is not a valid value", int32(v))
	}
	return nil
}

func checkDuration(field string, d *durationpb.Duration, lo, hi time.Duration) (time.Duration, error) {
	if err := d.CheckValid(); err != nil {
		return 0, invalid(field, "is not a valid duration")
	}
	v := d.AsDuration()
	if v < lo || v > hi {
		return 0, invalid(field, "must be in %s..%s, got %s", lo, hi, v)
	}
	return v, nil
}

func checkTimestamp(field string, ts *timestamppb.Timestamp) (time.Time, error) {
	if err := ts.CheckValid(); err != nil {
		return time.Time{}, invalid(field, "is not a valid timestamp")
	}
	return ts.AsTime(), nil
}

// checkSinkURL accepts absolute http and https URLs with a host and no
// credentials (a URL is shown to every viewer; the secret is not) whose
// host the egress policy allows as written (an IP literal or localhost).
func checkSinkURL(field, raw string, policy egress.Policy) error {
	if raw == "" {
		return invalid(field, "is required")
	}
	if len(raw) > maxURLLen {
		return invalid(field, "must be at most %d bytes", maxURLLen)
	}
	if strings.ContainsFunc(raw, func(r rune) bool { return unicode.IsControl(r) || unicode.IsSpace(r) }) {
		return invalid(field, "must not contain spaces or control characters")
	}
	u, err := url.Parse(raw)
	if err != nil {
		return invalid(field, "is not a valid URL")
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return invalid(field, "must be an http or https URL")
	}
	if u.Host == "" || u.Hostname() == "" {
		return invalid(field, "must name a host")
	}
	if u.User != nil {
		return invalid(field, "must not contain credentials; use the secret")
	}
	if err := policy.CheckURL(u); err != nil {
		return invalid(field, "%v", err)
	}
	return nil
}

// Standard Webhooks secrets: "whsec_" and the base64 of a 24..64-byte key.
const (
	whsecPrefix              = "whsec_"
	minWhsecKey, maxWhsecKey = 24, 64
)

// checkSinkSecret checks a sink's signing secret without ever echoing it.
func checkSinkSecret(field, secret string) error {
	if n := utf8.RuneCountInString(secret); n < minSecretLen || n > maxSecretLen {
		return invalid(field, "must be %d..%d characters", minSecretLen, maxSecretLen)
	}
	if err := checkText(field, secret, maxSecretLen); err != nil {
		return err
	}
	if rest, ok := strings.CutPrefix(secret, whsecPrefix); ok {
		key, err := base64.StdEncoding.DecodeString(rest)
		if err != nil || len(key) < minWhsecKey || len(key) > maxWhsecKey {
			return invalid(field, "a %s secret must be the standard base64 of a %d..%d-byte key", whsecPrefix, minWhsecKey, maxWhsecKey)
		}
	}
	return nil
}

// checkPayload refuses a typed kind's payload (pkg/cmdkind) that the node
// would refuse anyway, with the field path of the offending field, so the
// mistake is seen at CreateCommand instead of in a failed result later.
func checkPayload(kind string, payload []byte) error {
	if _, err := cmdkind.Parse(kind, payload); err != nil {
		return connect.NewError(connect.CodeInvalidArgument, err)
	}
	return nil
}

func abbrev(s string) string {
	if len(s) <= 40 {
		return s
	}
	return strings.ToValidUTF8(s[:40], "") + "…"
}
