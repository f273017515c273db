// Package selector is the one owner of leasehold's label selector syntax:
// comma-separated requirements, each one of
//
//	k=v  k==v     the label k is v
//	k!=v          the label k is not v (or k is absent)
//	k in (a,b)    the label k is one of a, b
//	k notin (a,b) the label k is none of a, b (or k is absent)
//	k             the label k is present
//	!k            the label k is absent
//
// A selector matches labels when every requirement does; the empty selector
// matches everything. Keys follow the label key rule
// (^[A-Za-z0-9]([A-Za-z0-9._/:-]{0,126}[A-Za-z0-9])?$); values are at most
// 256 bytes without spaces, control characters, ',', '(', ')', '=' or '!'.
// Parse reports the first error with its byte position. Matches evaluates a
// selector in Go; SQLCondition and Selector.SQLArg evaluate the same
// selector in PostgreSQL over a jsonb object of labels, with the
// requirements passed as one parameter (no SQL is built from input).
package selector

import (
	"encoding/json"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Op is a requirement's operator.
type Op string

// The operators. Equals and NotEquals are In and NotIn of one value.
const (
	OpIn        Op = "in"
	OpNotIn     Op = "notin"
	OpExists    Op = "exists"
	OpNotExists Op = "!exists"
)

// Requirement is one comma-separated part of a selector.
type Requirement struct {
	// Key is the label key.
	Key string `json:"k"`
	// Op is the operator.
	Op Op `json:"op"`
	// Values are the operands of In and NotIn (at least one); nil otherwise.
	Values []string `json:"v,omitempty"`
}

// Selector is a parsed selector: the AND of its requirements.
type Selector struct {
	// Requirements in the order written.
	Requirements []Requirement
}

// Limits of a selector.
const (
	// MaxLen is the longest selector accepted, in bytes.
	MaxLen = 4096
	// MaxRequirements is the most requirements one selector holds.
	MaxRequirements = 64
	// MaxValueLen is the longest value, in bytes.
	MaxValueLen = 256
)

var keyRE = regexp.MustCompile(KeyPattern)

// KeyPattern is what a label key must match, in a selector and anywhere a
// label is written (flags, join tokens).
const KeyPattern = `^[A-Za-z0-9]([A-Za-z0-9._/:-]{0,126}[A-Za-z0-9])?$`

// ValidKey reports whether k is a label key a selector can name.
func ValidKey(k string) bool { return keyRE.MatchString(k) }

// SyntaxError is Parse's error: Pos is the byte offset (0-based) where the
// problem was found.
type SyntaxError struct {
	// Pos is the byte offset of the problem in the input.
	Pos int
	// Msg says what was wrong.
	Msg string
}

// Error returns "at position N: msg".
func (e *SyntaxError) Error() string { return fmt.Sprintf("at position %d: %s", e.Pos, e.Msg) }

type parser struct {
	s   string
	pos int
}

func (p *parser) errf(pos int, format string, args ...any) error {
	return &SyntaxError{Pos: pos, Msg: fmt.Sprintf(format, args...)}
}

func (p *parser) skipSpace() {
	for p.pos < len(p.s) && (p.s[p.pos] == ' ' || p.s[p.pos] == '\t') {
		p.pos++
	}
}

func (p *parser) eof() bool { return p.pos >= len(p.s) }

// isWordByte is a byte of a key or value: anything but a separator.
func isWordByte(c byte) bool {
	switch c {
	case ' ', '\t', ',', '(', ')', '=', '!':
		return false
	}
	return true
}

// word reads a run of key/value bytes at the current position.
func (p *parser) word() (string, int) {
	start := p.pos
	for p.pos < len(p.s) && isWordByte(p.s[p.pos]) {
		p.pos++
	}
	return p.s[start:p.pos], start
}

func (p *parser) key() (string, error) {
	p.skipSpace()
	k, at := p.word()
	if k == "" {
		if p.eof() {
			return "", p.errf(at, "expected a label key, found the end")
		}
		return "", p.errf(at, "expected a label key, found %q", p.s[at])
	}
	if !keyRE.MatchString(k) {
		return "", p.errf(at, "key %q must match %s", abbrev(k), keyRE)
	}
	return k, nil
}

func (p *parser) value() (string, error) {
	p.skipSpace()
	v, at := p.word()
	if len(v) > MaxValueLen {
		return "", p.errf(at, "value is %d bytes, more than %d", len(v), MaxValueLen)
	}
	if strings.ContainsFunc(v, unicode.IsControl) || strings.ContainsFunc(v, unicode.IsSpace) {
		return "", p.errf(at, "value %q holds a control or space character", abbrev(v))
	}
	return v, nil
}

// set reads "(a, b, ...)".
func (p *parser) set() ([]string, error) {
	p.skipSpace()
	if p.eof() || p.s[p.pos] != '(' {
		return nil, p.errf(p.pos, "expected '(' to open the set of values")
	}
	p.pos++
	var vals []string
	for {
		p.skipSpace()
		at := p.pos
		v, err := p.value()
		if err != nil {
			return nil, err
		}
		if v == "" {
			return nil, p.errf(at, "expected a value in the set")
		}
		if !slices.Contains(vals, v) {
			vals = append(vals, v)
		}
		p.skipSpace()
		if p.eof() {
			return nil, p.errf(p.pos, "expected ',' or ')' in the set, found the end")
		}
		switch p.s[p.pos] {
		case ',':
			p.pos++
		case ')':
			p.pos++
			return vals, nil
		default:
			return nil, p.errf(p.pos, "expected ',' or ')' in the set, found %q", p.s[p.pos])
		}
	}
}

func (p *parser) requirement() (Requirement, error) {
	p.skipSpace()
	if !p.eof() && p.s[p.pos] == '!' {
		p.pos++
		k, err := p.key()
		if err != nil {
			return Requirement{}, err
		}
		return Requirement{Key: k, Op: OpNotExists}, nil
	}
	k, err := p.key()
	if err != nil {
		return Requirement{}, err
	}
	p.skipSpace()
	if p.eof() || p.s[p.pos] == ',' {
		return Requirement{Key: k, Op: OpExists}, nil
	}
	switch {
	case strings.HasPrefix(p.s[p.pos:], "=="):
		p.pos += 2
	case p.s[p.pos] == '=':
		p.pos++
	case strings.HasPrefix(p.s[p.pos:], "!="):
		p.pos += 2
		v, err := p.value()
		if err != nil {
			return Requirement{}, err
		}
		return Requirement{Key: k, Op: OpNotIn, Values: []string{v}}, nil
	default:
		at := p.pos
		w, _ := p.word()
		switch w {
		case "in":
			vals, err := p.set()
			return Requirement{Key: k, Op: OpIn, Values: vals}, err
		case "notin":
			vals, err := p.set()
			return Requirement{Key: k, Op: OpNotIn, Values: vals}, err
		case "":
			return Requirement{}, p.errf(at, "expected an operator (=, ==, !=, in, notin) or ',', found %q", p.s[at])
		}
		return Requirement{}, p.errf(at, "expected an operator (=, ==, !=, in, notin) or ',', found %q", abbrev(w))
	}
	v, err := p.value()
	if err != nil {
		return Requirement{}, err
	}
	return Requirement{Key: k, Op: OpIn, Values: []string{v}}, nil
}

// Parse parses s. The empty (or all-blank) string is the selector that
// matches everything. An error is a *SyntaxError naming the byte position.
func Parse(s string) (Selector, error) {
	if len(s) > MaxLen {
		return Selector{}, &SyntaxError{Pos: MaxLen, Msg: fmt.Sprintf("selector is %d bytes, more than %d", len(s), MaxLen)}
	}
	if !utf8.ValidString(s) {
		return Selector{}, &SyntaxError{Pos: 0, Msg: "selector is not valid UTF-8"}
	}
	p := &parser{s: s}
	var sel Selector
	p.skipSpace()
	if p.eof() {
		return sel, nil
	}
	for {
		if len(sel.Requirements) == MaxRequirements {
			return Selector{}, p.errf(p.pos, "more than %d requirements", MaxRequirements)
		}
		r, err := p.requirement()
		if err != nil {
			return Selector{}, err
		}
		sel.Requirements = append(sel.Requirements, r)
		p.skipSpace()
		if p.eof() {
			return sel, nil
		}
		if p.s[p.pos] != ',' {
			return Selector{}, p.errf(p.pos, "expected ',' between requirements, found %q", p.s[p.pos])
		}
		p.pos++
		p.skipSpace()
		if p.eof() {
			return Selector{}, p.errf(p.pos, "expected a requirement after ',', found the end")
		}
	}
}

// Empty reports whether the selector matches everything.
func (s Selector) Empty() bool { return len(s.Requirements) == 0 }

// Matches reports whether labels satisfy every requirement.
func (s Selector) Matches(labels map[string]string) bool {
	for _, r := range s.Requirements {
		v, ok := labels[r.Key]
		var m bool
		switch r.Op {
		case OpExists:
			m = ok
		case OpNotExists:
			m = !ok
		case OpIn:
			m = ok && slices.Contains(r.Values, v)
		case OpNotIn:
			m = !ok || !slices.Contains(r.Values, v)
		}
		if !m {
			return false
		}
	}
	return true
}

// String returns the selector in canonical form (Parse of it gives the same
// selector).
func (s Selector) String() string {
	parts := make([]string, 0, len(s.Requirements))
	for _, r := range s.Requirements {
		switch {
		case r.Op == OpExists:
			parts = append(parts, r.Key)
		case r.Op == OpNotExists:
			parts = append(parts, "!"+r.Key)
		case r.Op == OpIn && len(r.Values) == 1:
			parts = append(parts, r.Key+"="+r.Values[0])
		case r.Op == OpNotIn && len(r.Values) == 1:
			parts = append(parts, r.Key+"!="+r.Values[0])
		default:
			parts = append(parts, r.Key+" "+string(r.Op)+" ("+strings.Join(r.Values, ",")+")")
		}
	}
	return strings.Join(parts, ",")
}

// SQLArg is the selector as the one jsonb parameter SQLCondition reads: a
// JSON array of {"k", "op", "v"}. Pass it as text (not []byte), which
// works behind PgBouncer's simple protocol too.
func (s Selector) SQLArg() string {
	reqs := s.Requirements
	if reqs == nil {
		reqs = []Requirement{}
	}
	b, _ := json.Marshal(reqs) // strings and slices only: cannot fail
	return string(b)
}

// SQLCondition returns a boolean SQL expression that is true when the
// labels (a jsonb object; labels is an SQL expression written by the
// caller's code, e.g. "n.labels", never input) satisfy the selector passed
// as param (a placeholder such as "$3", bound to Selector.SQLArg()). It
// agrees with Matches for labels whose values are strings.
func SQLCondition(labels, param string) string {
	return `NOT EXISTS (SELECT 1 FROM jsonb_to_recordset(` + param + `::jsonb) AS sel_r(k text, op text, v text[])
 WHERE NOT CASE sel_r.op
   WHEN 'exists' THEN (` + labels + `) ? sel_r.k
   WHEN '!exists' THEN NOT (` + labels + `) ? sel_r.k
   WHEN 'in' THEN coalesce((` + labels + `) ->> sel_r.k = ANY (sel_r.v), false)
   WHEN 'notin' THEN NOT coalesce((` + labels + `) ->> sel_r.k = ANY (sel_r.v), false)
   ELSE false END)`
}

func abbrev(s string) string {
	if len(s) <= 40 {
		return s
	}
	return strings.ToValidUTF8(s[:40], "") + "…"
}
