// Package nodeauth is a node's identity without a database: the node id's
// syntax, the credential's format and stored hash, and the node a client
// certificate names. The agents on the machines use it as it is; the
// control plane registers and verifies nodes against PostgreSQL with
// pkg/nodereg, built on it.
//
// A credential is 32 random bytes, base64url-encoded behind the prefix
// "lhn_", returned once at registration. The database keeps only its
// SHA-256 (Hash). A high-entropy random token needs no slow password hash:
// guessing it is as hard as guessing the key.
package nodeauth

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"regexp"
	"strings"
)

// Prefix starts every credential, so a leaked one is recognisable.
const Prefix = "lhn_"

// MaxCredentialLen bounds the credential a node may present; longer ones
// are refused before hashing.
const MaxCredentialLen = 256

var nodeIDPattern = regexp.MustCompile(`^[A-Za-z0-9._:@-]{1,200}$`)

// ValidateNodeID checks a node id against the nodes table's constraint.
func ValidateNodeID(id string) error {
	if !nodeIDPattern.MatchString(id) {
		return fmt.Errorf("node id %q must match %s", truncate(id, 40), nodeIDPattern)
	}
	return nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// Hash is the stored form of a credential.
func Hash(credential string) []byte {
	h := sha256.Sum256([]byte(credential))
	return h[:]
}

// credentialBytes is the random part of a credential, before encoding.
const credentialBytes = 32

// credentialLen is the length of every credential NewCredential issues:
// the prefix and credentialBytes in unpadded base64url.
var credentialLen = len(Prefix) + base64.RawURLEncoding.EncodedLen(credentialBytes)

// WellFormed reports whether c could be a credential NewCredential issued
// (the prefix, then exactly the base64url encoding of credentialBytes), the
// only kind the database holds hashes of: one that cannot be is refused
// without a database read.
func WellFormed(c string) bool {
	if len(c) != credentialLen || !strings.HasPrefix(c, Prefix) {
		return false
	}
	return !strings.ContainsFunc(c[len(Prefix):], func(r rune) bool { return !base64URLRune(r) })
}

// base64URLRune reports whether r is in the base64url alphabet.
func base64URLRune(r rune) bool {
	return 'A' <= r && r <= 'Z' || 'a' <= r && r <= 'z' || '0' <= r && r <= '9' || r == '-' || r == '_'
}

// NewCredential returns a fresh random credential.
func NewCredential() (string, error) {
	b := make([]byte, credentialBytes)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("generate credential: %w", err)
	}
	return Prefix + base64.RawURLEncoding.EncodeToString(b), nil
}
