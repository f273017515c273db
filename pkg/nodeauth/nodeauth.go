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

// NewCredential returns a fresh random credential.
func NewCredential() (string, error) {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("generate credential: %w", err)
	}
	return Prefix + base64.RawURLEncoding.EncodeToString(b), nil
}
