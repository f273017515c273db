// Package relaytoken reads the shared bearer token that authenticates the
// api to the gateways' tunnel relays. Both sides read it through Read, so
// they agree on its format: the file's content with surrounding whitespace
// trimmed, at least MinLength characters.
package relaytoken

import (
	"fmt"
	"os"
	"strings"
)

// MinLength is the shortest token Read accepts.
const MinLength = 16

// Read returns the token held in path. Its errors name flag, the flag the
// path came from, so an operator sees which setting to fix.
func Read(flag, path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("%s: %w", flag, err)
	}
	tok := strings.TrimSpace(string(b))
	if len(tok) < MinLength {
		return "", fmt.Errorf("%s %s: the token must be at least %d characters", flag, path, MinLength)
	}
	return tok, nil
}
