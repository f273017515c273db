package coord

import (
	"errors"
	"fmt"
	"regexp"
	"time"
)

// Limits of lease names and TTLs (docs/design.md#leases).
const (
	MaxNameLen = 200
	MinTTL     = time.Millisecond
	MaxTTL     = 24 * time.Hour
)

var nameRE = regexp.MustCompile(`^[A-Za-z0-9._:@/-]{1,200}$`)

// Sentinels matched with errors.Is on a *ValidationError.
var (
	ErrInvalidName  = errors.New("invalid lease name")
	ErrInvalidTTL   = errors.New("invalid lease TTL")
	ErrInvalidOwner = errors.New("invalid lease owner")
)

// ValidationError is bad input caught before any SQL runs. Field names the
// offending input; errors.Is matches ErrInvalidName, ErrInvalidTTL or
// ErrInvalidOwner.
type ValidationError struct {
	Field  string
	Value  string
	Reason string
	kind   error
}

func (e *ValidationError) Error() string {
	return fmt.Sprintf("%s: %s %q %s", e.kind, e.Field, e.Value, e.Reason)
}

// Unwrap returns the sentinel of the error's kind.
func (e *ValidationError) Unwrap() error { return e.kind }

// ValidateName checks a lease name against ^[A-Za-z0-9._:@/-]{1,200}$.
func ValidateName(name string) error {
	switch {
	case name == "":
		return &ValidationError{Field: "name", Value: name, Reason: "is empty", kind: ErrInvalidName}
	case len(name) > MaxNameLen:
		return &ValidationError{Field: "name", Value: name[:32] + "…", Reason: fmt.Sprintf("is %d bytes, longer than %d", len(name), MaxNameLen), kind: ErrInvalidName}
	case !nameRE.MatchString(name):
		return &ValidationError{Field: "name", Value: name, Reason: "may contain only A-Z a-z 0-9 . _ : @ / -", kind: ErrInvalidName}
	}
	return nil
}

// ValidateNames checks every name and refuses duplicates.
func ValidateNames(names []string) error {
	if len(names) == 0 {
		return &ValidationError{Field: "names", Reason: "is empty", kind: ErrInvalidName}
	}
	seen := make(map[string]struct{}, len(names))
	for _, n := range names {
		if err := ValidateName(n); err != nil {
			return err
		}
		if _, dup := seen[n]; dup {
			return &ValidationError{Field: "names", Value: n, Reason: "is listed twice", kind: ErrInvalidName}
		}
		seen[n] = struct{}{}
	}
	return nil
}

// ValidateTTL checks that ttl is a whole number of milliseconds in [1 ms, 24 h].
func ValidateTTL(ttl time.Duration) error {
	switch {
	case ttl < MinTTL:
		return &ValidationError{Field: "ttl", Value: ttl.String(), Reason: "must be at least 1ms", kind: ErrInvalidTTL}
	case ttl > MaxTTL:
		return &ValidationError{Field: "ttl", Value: ttl.String(), Reason: "must be at most 24h", kind: ErrInvalidTTL}
	case ttl%time.Millisecond != 0:
		return &ValidationError{Field: "ttl", Value: ttl.String(), Reason: "must be a whole number of milliseconds", kind: ErrInvalidTTL}
	}
	return nil
}

// ValidateOwner checks a process id used as lease owner: same alphabet as
// names, so it can be embedded in names and logs safely.
func ValidateOwner(owner string) error {
	if owner == "" || len(owner) > MaxNameLen || !nameRE.MatchString(owner) {
		return &ValidationError{Field: "owner", Value: owner, Reason: "must match " + nameRE.String(), kind: ErrInvalidOwner}
	}
	return nil
}
