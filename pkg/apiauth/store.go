package apiauth

import (
	"bytes"
	"strings"
	"sync/atomic"
)

// Store holds the keyring in force and lets a reload replace it while
// calls authenticate: each call sees either the old or the new keyring,
// whole. The zero Store accepts nothing.
type Store struct {
	k atomic.Pointer[Keyring]
}

// NewStore returns a Store holding k.
func NewStore(k *Keyring) *Store {
	s := &Store{}
	s.k.Store(k)
	return s
}

// Swap installs k for every later call.
func (s *Store) Swap(k *Keyring) { s.k.Store(k) }

// Authenticate is Keyring.Authenticate on the keyring in force.
func (s *Store) Authenticate(token string) (Identity, bool) {
	return s.k.Load().Authenticate(token)
}

// Len is the number of tokens in force.
func (s *Store) Len() int {
	if k := s.k.Load(); k != nil {
		return k.Len()
	}
	return 0
}

// LoadContents is Load with the tokens file already read (its contents
// file, named by fileSource in errors), for reloads of a changed file.
func LoadContents(fileSource string, file []byte, inline, inlineSource string) (*Keyring, error) {
	k := &Keyring{}
	if err := k.add(fileSource, bytes.NewReader(file)); err != nil {
		return nil, err
	}
	if inline != "" {
		if err := k.add(inlineSource, strings.NewReader(inline)); err != nil {
			return nil, err
		}
	}
	return k, nil
}

// Keyring is the keyring in force.
func (s *Store) Keyring() *Keyring { return s.k.Load() }

// LoadContentsLenient is LoadContents that skips what does not parse: it
// returns the entries of every line that parses, and the errors of those
// that do not (naming the line, never the token).
func LoadContentsLenient(fileSource string, file []byte, inline, inlineSource string) (*Keyring, []error) {
	k := &Keyring{}
	errs := k.addLenient(fileSource, bytes.NewReader(file))
	if inline != "" {
		errs = append(errs, k.addLenient(inlineSource, strings.NewReader(inline))...)
	}
	return k, errs
}

// Restrict returns the entries of k that also appear in to, each with the
// smaller of its two roles: what a tokens file that does not parse may
// still take away (a revoked or demoted token) without granting anything
// (an added or promoted one waits until the file parses).
func (k *Keyring) Restrict(to *Keyring) *Keyring {
	out := &Keyring{}
	if k == nil || to == nil {
		return out
	}
	for _, e := range k.entries {
		for _, n := range to.entries {
			if e.hash == n.hash {
				out.entries = append(out.entries, entry{hash: e.hash, role: min(e.role, n.role)})
				break
			}
		}
	}
	return out
}

// Equal reports whether k and o hold the same tokens with the same roles.
func (k *Keyring) Equal(o *Keyring) bool {
	if k.Len() != o.Len() {
		return false
	}
	return k.Restrict(o).Len() == k.Len() && o.Restrict(k).Len() == o.Len() && k.rolesMatch(o)
}

// rolesMatch reports whether every token of k has the same role in o.
func (k *Keyring) rolesMatch(o *Keyring) bool {
	for _, e := range k.entries {
		for _, n := range o.entries {
			if e.hash == n.hash && e.role != n.role {
				return false
			}
		}
	}
	return true
}
