package coord_test

import (
	"errors"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/leasehold/leasehold/pkg/coord"
)

// nameAllowed is the lease-name alphabet of docs/design.md#leases, written out
// by hand so the fuzzers check ValidateName against a second implementation
// of ^[A-Za-z0-9._:@/-]{1,200}$ rather than against its own regexp.
func nameAllowed(name string) bool {
	if len(name) < 1 || len(name) > 200 {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case c == '.', c == '_', c == ':', c == '@', c == '/', c == '-':
		default:
			return false
		}
	}
	return true
}

// FuzzValidateName: ValidateName, ValidateNames and ValidateOwner never
// panic, agree with the alphabet, and refuse with a typed error whose
// message stays printable.
func FuzzValidateName(f *testing.F) {
	for _, s := range []string{"shard:0", "scheduler/shard:255", "singleton:sink:audit", "gateway:gw-1", "site:s1:boot",
		"pool:p@x", "", " ", "a b", "é", "shard:\x00", "x\n", string(make([]byte, 201)), "ok.name_1-2/3@4:5"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		want := nameAllowed(name)
		err := coord.ValidateName(name)
		if (err == nil) != want {
			t.Fatalf("ValidateName(%q) = %v, alphabet says valid=%v", name, err, want)
		}
		if err != nil {
			if !errors.Is(err, coord.ErrInvalidName) {
				t.Fatalf("ValidateName(%q) error %v is not ErrInvalidName", name, err)
			}
			var ve *coord.ValidationError
			if !errors.As(err, &ve) || ve.Field != "name" {
				t.Fatalf("ValidateName(%q) error %#v is not a *ValidationError on name", name, err)
			}
			// The value is quoted (at most 4 bytes per input byte, and long
			// names are cut to 32 bytes): a log line stays bounded.
			if len(err.Error()) > 4*min(len(name), coord.MaxNameLen)+200 || !utf8.ValidString(err.Error()) {
				t.Fatalf("ValidateName(%q): message too long or mangled: %q", name, err.Error())
			}
		}
		if oerr := coord.ValidateOwner(name); (oerr == nil) != want {
			t.Fatalf("ValidateOwner(%q) = %v, alphabet says valid=%v", name, oerr, want)
		}
		// A list is valid when every name is and none repeats.
		if lerr := coord.ValidateNames([]string{name, name + "x"}); (lerr == nil) != (want && nameAllowed(name+"x")) {
			t.Fatalf("ValidateNames(%q, %q) = %v", name, name+"x", lerr)
		}
		if lerr := coord.ValidateNames([]string{name, name}); lerr == nil {
			t.Fatalf("ValidateNames accepted %q twice", name)
		}
	})
}

// FuzzValidateTTL: ValidateTTL never panics and accepts exactly the whole
// milliseconds in [1 ms, 24 h].
func FuzzValidateTTL(f *testing.F) {
	for _, d := range []time.Duration{0, 1, time.Millisecond, time.Millisecond + 1, time.Second, 15 * time.Second,
		24 * time.Hour, 24*time.Hour + time.Millisecond, -time.Millisecond, 1<<63 - 1, -1 << 63} {
		f.Add(int64(d))
	}
	f.Fuzz(func(t *testing.T, ns int64) {
		ttl := time.Duration(ns)
		want := ttl >= time.Millisecond && ttl <= 24*time.Hour && ns%int64(time.Millisecond) == 0
		err := coord.ValidateTTL(ttl)
		if (err == nil) != want {
			t.Fatalf("ValidateTTL(%d) = %v, want valid=%v", ns, err, want)
		}
		if err != nil && !errors.Is(err, coord.ErrInvalidTTL) {
			t.Fatalf("ValidateTTL(%d) error %v is not ErrInvalidTTL", ns, err)
		}
	})
}
