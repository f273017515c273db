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
