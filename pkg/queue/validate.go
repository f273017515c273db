package queue

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/leasehold/leasehold/pkg/coord"
)

// Limits of the queue's inputs. The table's CHECKs repeat the length limits;
// these checks run first so bad input never reaches SQL.
const (
	MaxReconcilerLen = 100
	MaxKeyLen        = 500 // bytes
	MaxOwnerLen      = 200
	MaxClaimLimit    = 10000
	MinClaimTTL      = time.Millisecond
	MaxClaimTTL      = 24 * time.Hour
	// MaxDelay bounds an enqueue's delay: a key due further out than this
	// is almost certainly a unit mistake.
	MaxDelay = 30 * 24 * time.Hour
)

var (
	reconcilerRE = regexp.MustCompile(`^[a-z0-9._-]{1,100}$`)
	ownerRE      = regexp.MustCompile(`^[A-Za-z0-9._:@/-]{1,200}$`)
)

// ErrInvalidInput is matched with errors.Is by every *ValidationError.
var ErrInvalidInput = errors.New("invalid work queue input")

// ValidationError is bad input caught before any SQL runs. Field names the
// offending argument ("reconciler", "key", "owner", "shards", …).
type ValidationError struct {
	Field  string
	Value  string // abbreviated to 40 bytes
	Reason string
}

func (e *ValidationError) Error() string {
	return fmt.Sprintf("work queue: invalid %s %q: %s", e.Field, e.Value, e.Reason)
}

// Unwrap makes errors.Is(err, ErrInvalidInput) true.
func (e *ValidationError) Unwrap() error { return ErrInvalidInput }

func invalid(field, value, reason string) *ValidationError {
	if len(value) > 40 {
		value = strings.ToValidUTF8(value[:40], "") + "…"
	}
	return &ValidationError{Field: field, Value: value, Reason: reason}
}

// ValidateReconciler checks a reconciler name: 1..100 of [a-z0-9._-].
func ValidateReconciler(name string) error {
	if !reconcilerRE.MatchString(name) {
		return invalid("reconciler", name, fmt.Sprintf("must be 1..%d characters of a-z 0-9 . _ -", MaxReconcilerLen))
	}
	return nil
}

// ValidateKey checks a key: 1..500 bytes of valid UTF-8 without NUL.
func ValidateKey(key string) error {
	switch {
	case key == "":
		return invalid("key", key, "is empty")
	case len(key) > MaxKeyLen:
		return invalid("key", key, fmt.Sprintf("is %d bytes, longer than %d", len(key), MaxKeyLen))
	case !utf8.ValidString(key):
		return invalid("key", key, "is not valid UTF-8")
	case strings.IndexByte(key, 0) >= 0:
		return invalid("key", key, "contains NUL")
	}
	return nil
}

// ValidateOwner checks a claimer's id: the alphabet of lease owners.
func ValidateOwner(owner string) error {
	if !ownerRE.MatchString(owner) {
		return invalid("owner", owner, "must match "+ownerRE.String())
	}
	return nil
}

func validateDelay(d time.Duration) error {
	if d < 0 || d > MaxDelay {
		return invalid("delay", d.String(), fmt.Sprintf("must be in [0, %s]", MaxDelay))
	}
	return nil
}

func validateShards(shards []int) error {
	for _, s := range shards {
		if s < 0 || s >= coord.NumShards {
			return invalid("shards", fmt.Sprint(s), fmt.Sprintf("must be in [0, %d]", coord.NumShards-1))
		}
	}
	return nil
}

func validateClaimTTL(ttl time.Duration) error {
	switch {
	case ttl < MinClaimTTL || ttl > MaxClaimTTL:
		return invalid("claimTTL", ttl.String(), "must be in [1ms, 24h]")
	case ttl%time.Millisecond != 0:
		return invalid("claimTTL", ttl.String(), "must be a whole number of milliseconds")
	}
	return nil
}

func validateLimit(limit int) error {
	if limit < 1 || limit > MaxClaimLimit {
		return invalid("limit", fmt.Sprint(limit), fmt.Sprintf("must be in [1, %d]", MaxClaimLimit))
	}
	return nil
}

// validateItem checks an item handed back to Complete or Fail: it must be a
// claim returned by Claim.
func validateItem(it Item) error {
	if err := ValidateReconciler(it.Reconciler); err != nil {
		return err
	}
	if err := ValidateKey(it.Key); err != nil {
		return err
	}
	if err := ValidateOwner(it.Owner); err != nil {
		return err
	}
	if it.ClaimedUntil.IsZero() || it.Generation < 1 {
		return invalid("item", it.Key, "is not a claim returned by Claim")
	}
	return nil
}
