// Package relaytoken reads the shared bearer token that authenticates the
// api to the gateways' tunnel relays. Both sides read it through this
// package, so they agree on its format: the file's content with surrounding
// whitespace trimmed, at least MinLength characters. A Token follows its
// file, so a rotated token applies without a restart.
package relaytoken

import (
	"crypto/subtle"
	"fmt"
	"strings"
	"sync/atomic"

	"github.com/leasehold/leasehold/pkg/reload"
)

// MinLength is the shortest token accepted.
const MinLength = 16

// parse is the token of a file's content b, read from path (flag names
// the setting it came from, for errors).
func parse(flag, path string, b []byte) (string, error) {
	tok := strings.TrimSpace(string(b))
	if len(tok) < MinLength {
		return "", fmt.Errorf("%s %s: the token must be at least %d characters", flag, path, MinLength)
	}
	return tok, nil
}

// Token is the token of a file that may change: Run (of the embedded
// Watcher) re-reads it, and a version that is too short keeps the previous
// token in force (counted as a failed reload).
type Token struct {
	*reload.Watcher
	tok atomic.Pointer[string]
}

// Watch reads path (an error names flag) and returns a Token that follows
// it once its Run is started. component names the watcher in logs and
// metrics.
func Watch(component, flag, path string, opts reload.Options) (*Token, error) {
	t := &Token{}
	w, err := reload.NewWatcher(component, []string{path}, func(c [][]byte) error {
		tok, err := parse(flag, path, c[0])
		if err != nil {
			return err
		}
		t.tok.Store(&tok)
		return nil
	}, opts)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", flag, err)
	}
	t.Watcher = w
	return t, nil
}

// Value is the token in force.
func (t *Token) Value() string { return *t.tok.Load() }

// Authorizes reports, in constant time for a header of the right length,
// whether header is "Bearer " followed by the token in force.
func (t *Token) Authorizes(header string) bool {
	return subtle.ConstantTimeCompare([]byte(header), []byte("Bearer "+t.Value())) == 1
}
