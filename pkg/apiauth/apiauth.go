// Package apiauth authenticates the bearer tokens of leasehold's operator
// APIs and gives each one a role (docs/design.md#observability).
//
// Tokens are configured as lines "role:token" or "role:sha256:<64 hex>"
// (the SHA-256 of the token, so the configuration need not hold it in
// clear), one per line or separated by commas; blank lines and lines
// starting with '#' are ignored. A Keyring keeps only SHA-256 hashes:
// Authenticate hashes the presented token and compares it with every stored
// hash in constant time, with no early exit, so timing tells nothing about
// which token (if any) came close. Nothing in this package ever formats a
// token into an error or a log line.
package apiauth

import (
	"bufio"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
)

// Role is what a token may do. Roles are ordered: every role may do what the
// roles below it may.
type Role int

// Roles, lowest first. RoleNone is no role at all (an unknown token).
const (
	RoleNone Role = iota
	// RoleViewer reads: every Get, List and Wait call.
	RoleViewer
	// RoleOperator also runs the fleet: commands and pool leases.
	RoleOperator
	// RoleTunnel also opens interactive tunnels to nodes (OpenTunnel): a
	// port on a node's loopback or its shell.
	RoleTunnel
	// RoleAdmin also changes its shape: nodes, pools and sinks.
	RoleAdmin
)

var roleNames = map[string]Role{"viewer": RoleViewer, "operator": RoleOperator, "tunnel": RoleTunnel, "admin": RoleAdmin}

func (r Role) String() string {
	switch r {
	case RoleViewer:
		return "viewer"
	case RoleOperator:
		return "operator"
	case RoleTunnel:
		return "tunnel"
	case RoleAdmin:
		return "admin"
	default:
		return "none"
	}
}

// Allows reports whether r may do what needs role need.
func (r Role) Allows(need Role) bool { return r != RoleNone && r >= need }

// ParseRole parses "viewer", "operator", "tunnel" or "admin".
func ParseRole(s string) (Role, error) {
	if r, ok := roleNames[s]; ok {
		return r, nil
	}
	return RoleNone, fmt.Errorf("unknown role %q: must be viewer, operator, tunnel or admin", s)
}

// Token limits: long enough to be unguessable, short enough to bound work.
const (
	MinTokenLen = 16
	MaxTokenLen = 512
)

// tokenRE is the alphabet of a clear token: base64, base64url and hex fit,
// and so does the lhn_-style prefix convention.
var tokenRE = regexp.MustCompile(`^[A-Za-z0-9._~+/=-]+$`)

// Identity is an authenticated caller.
type Identity struct {
	// Role is what the caller may do.
	Role Role
	// ID names the token without revealing it: "sha256:" and the first 12
	// hex digits of its hash. It is safe to log for audit.
	ID string
}

type entry struct {
	hash [sha256.Size]byte
	role Role
}

// Keyring holds token hashes and their roles. The zero Keyring accepts
// nothing.
type Keyring struct {
	entries []entry
}

// Len is the number of tokens in the keyring.
func (k *Keyring) Len() int { return len(k.entries) }

// HashToken returns the "sha256:<hex>" form of token, for configuration
// files that should not hold tokens in clear.
func HashToken(token string) string {
	h := sha256.Sum256([]byte(token))
	return "sha256:" + hex.EncodeToString(h[:])
}

// Parse reads token lines from r; source names r in errors ("--tokens-file
// /etc/x", "LEASEHOLD_API_TOKENS"). Errors give the line number and never
// the token.
func Parse(source string, r io.Reader) (*Keyring, error) {
	k := &Keyring{}
	if err := k.add(source, r); err != nil {
		return nil, err
	}
	return k, nil
}

// Load builds a keyring from a tokens file (skipped when path is "") and an
// inline list such as the value of an environment variable (skipped when
// empty). Both may be given; a hash configured twice is refused.
func Load(path, inline, inlineSource string) (*Keyring, error) {
	k := &Keyring{}
	if path != "" {
		f, err := os.Open(path)
		if err != nil {
			return nil, fmt.Errorf("tokens file: %w", err)
		}
		defer f.Close()
		if err := k.add("tokens file "+path, f); err != nil {
			return nil, err
		}
	}
	if inline != "" {
		if err := k.add(inlineSource, strings.NewReader(inline)); err != nil {
			return nil, err
		}
	}
	return k, nil
}

func (k *Keyring) add(source string, r io.Reader) error {
	if errs := k.scan(source, r, true); len(errs) > 0 {
		return errs[0]
	}
	return nil
}

// addLenient is add that goes past a line that does not parse: it keeps
// every other entry and returns the errors.
func (k *Keyring) addLenient(source string, r io.Reader) []error {
	return k.scan(source, r, false)
}

// scan reads token lines from r into k. Strict, it stops at the first
// line that does not parse or repeats a token; lenient, it skips such
// lines and reports them all. Errors give the line number, never the token.
func (k *Keyring) scan(source string, r io.Reader, strict bool) []error {
	var errs []error
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 64<<10)
	line := 0
	for sc.Scan() {
		line++
		for _, item := range strings.Split(sc.Text(), ",") {
			item = strings.TrimSpace(item)
			if item == "" || strings.HasPrefix(item, "#") {
				continue
			}
			e, err := parseEntry(item)
			if err == nil && strict && k.has(e) {
				err = errors.New("token configured twice")
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("%s line %d: %w", source, line, err))
				if strict {
					return errs
				}
				continue
			}
			k.entries = append(k.entries, e)
		}
	}
	if err := sc.Err(); err != nil {
		errs = append(errs, fmt.Errorf("%s: %w", source, err))
	}
	return errs
}

// has reports whether e's token is in k, in constant time per entry.
func (k *Keyring) has(e entry) bool {
	for _, have := range k.entries {
		if subtle.ConstantTimeCompare(have.hash[:], e.hash[:]) == 1 {
			return true
		}
	}
	return false
}

func parseEntry(item string) (entry, error) {
	roleName, rest, ok := strings.Cut(item, ":")
	if !ok {
		return entry{}, errors.New(`want "role:token" or "role:sha256:<hex>"`)
	}
	role, err := ParseRole(roleName)
	if err != nil {
		return entry{}, err
	}
	var e entry
	e.role = role
	if h, ok := strings.CutPrefix(rest, "sha256:"); ok {
		b, err := hex.DecodeString(h)
		if err != nil || len(b) != sha256.Size {
			return entry{}, errors.New("sha256: must be followed by 64 hex digits")
		}
		copy(e.hash[:], b)
		return e, nil
	}
	if len(rest) < MinTokenLen || len(rest) > MaxTokenLen {
		return entry{}, fmt.Errorf("token must be %d..%d characters", MinTokenLen, MaxTokenLen)
	}
	if !tokenRE.MatchString(rest) {
		return entry{}, errors.New("token may hold only A-Z a-z 0-9 . _ ~ + / = -")
	}
	e.hash = sha256.Sum256([]byte(rest))
	return e, nil
}

// Authenticate returns the identity of token, or false when no configured
// token matches. Its running time does not depend on which entry matched.
func (k *Keyring) Authenticate(token string) (Identity, bool) {
	if k == nil || len(token) == 0 || len(token) > MaxTokenLen {
		return Identity{}, false
	}
	h := sha256.Sum256([]byte(token))
	role := 0
	for _, e := range k.entries {
		eq := subtle.ConstantTimeCompare(e.hash[:], h[:])
		role = subtle.ConstantTimeSelect(eq, int(e.role), role)
	}
	if Role(role) == RoleNone {
		return Identity{}, false
	}
	return Identity{Role: Role(role), ID: "sha256:" + hex.EncodeToString(h[:6])}, true
}

// BearerToken extracts the token of an "Authorization: Bearer <token>"
// header value; the scheme is case-insensitive.
func BearerToken(header string) (string, bool) {
	scheme, token, ok := strings.Cut(header, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	token = strings.TrimSpace(token)
	return token, token != ""
}

// TokenPrefix starts every token GenerateToken makes, so a leaked one is
// easy to recognise (secret scanners, logs).
const TokenPrefix = "lhapi_"

// GenerateToken returns a new token: TokenPrefix and 32 bytes from
// crypto/rand in unpadded base64url (256 bits, 49 printable characters
// that need no quoting in a shell, a header or a tokens file).
func GenerateToken() (string, error) {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("generate token: %w", err)
	}
	return TokenPrefix + base64.RawURLEncoding.EncodeToString(b), nil
}

// ConfigLine is the tokens-file line that gives token role without
// holding the token in clear: "role:sha256:<hex>".
func ConfigLine(role Role, token string) string {
	return role.String() + ":" + HashToken(token)
}
