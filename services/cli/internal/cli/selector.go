package cli

import (
	"fmt"
	"regexp"
	"sort"
	"strings"
)

// A Selector is a parsed label selector, kubectl-style: requirements joined
// by commas, all of which must hold.
type Selector []requirement

type selOp int

const (
	opEquals selOp = iota
	opNotEquals
	opIn
	opNotIn
	opExists
	opNotExists
)

type requirement struct {
	key    string
	op     selOp
	values []string
}

var labelKeyRE = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._/:-]{0,126}[A-Za-z0-9])?$`)

// ParseSelector parses k=v, k==v, k!=v, "k in (a,b)", "k notin (a,b)", k and
// !k, joined by commas. An empty string selects everything.
func ParseSelector(s string) (Selector, error) {
	p := &selParser{s: s}
	var sel Selector
	p.space()
	if p.eof() {
		return nil, nil
	}
	for {
		r, err := p.requirement()
		if err != nil {
			return nil, err
		}
		sel = append(sel, r)
		p.space()
		if p.eof() {
			return sel, nil
		}
		if !p.take(",") {
			return nil, p.errorf("want , between requirements")
		}
		p.space()
	}
}

type selParser struct {
	s   string
	pos int
}

func (p *selParser) eof() bool { return p.pos >= len(p.s) }

func (p *selParser) errorf(format string, args ...any) error {
	return fmt.Errorf("selector %q at offset %d: %s", p.s, p.pos, fmt.Sprintf(format, args...))
}

func (p *selParser) space() {
	for !p.eof() && (p.s[p.pos] == ' ' || p.s[p.pos] == '\t') {
		p.pos++
	}
}

func (p *selParser) take(tok string) bool {
	if strings.HasPrefix(p.s[p.pos:], tok) {
		p.pos += len(tok)
		return true
	}
	return false
}

// word reads a key or a value: anything up to a space or one of ,()=!
func (p *selParser) word() string {
	start := p.pos
	for !p.eof() && !strings.ContainsRune(" \t,()=!", rune(p.s[p.pos])) {
		p.pos++
	}
	return p.s[start:p.pos]
}

func (p *selParser) key() (string, error) {
	p.space()
	k := p.word()
	if k == "" {
		return "", p.errorf("want a label key")
	}
	if !labelKeyRE.MatchString(k) {
		return "", p.errorf("label key %q must match %s", k, labelKeyRE)
	}
	return k, nil
}

func (p *selParser) requirement() (requirement, error) {
	if p.take("!") {
		k, err := p.key()
		if err != nil {
			return requirement{}, err
		}
		return requirement{key: k, op: opNotExists}, nil
	}
	k, err := p.key()
	if err != nil {
		return requirement{}, err
	}
	p.space()
	switch {
	case p.eof() || p.s[p.pos] == ',':
		return requirement{key: k, op: opExists}, nil
	case p.take("!="):
		return requirement{key: k, op: opNotEquals, values: []string{p.value()}}, nil
	case p.take("=="), p.take("="):
		return requirement{key: k, op: opEquals, values: []string{p.value()}}, nil
	}
	word := p.word()
	var op selOp
	switch word {
	case "in":
		op = opIn
	case "notin":
		op = opNotIn
	default:
		return requirement{}, p.errorf("want =, ==, !=, in or notin after %q", k)
	}
	p.space()
	if !p.take("(") {
		return requirement{}, p.errorf("want ( after %s", word)
	}
	var values []string
	for {
		p.space()
		v := p.word()
		if v == "" {
			return requirement{}, p.errorf("want a value in the list of %s", word)
		}
		values = append(values, v)
		p.space()
		if p.take(")") {
			break
		}
		if !p.take(",") {
			return requirement{}, p.errorf("want , or ) in the list of %s", word)
		}
	}
	return requirement{key: k, op: op, values: values}, nil
}

func (p *selParser) value() string {
	p.space()
	return p.word()
}

// Matches reports whether labels satisfy every requirement.
func (s Selector) Matches(labels map[string]string) bool {
	for _, r := range s {
		v, has := labels[r.key]
		switch r.op {
		case opExists:
			if !has {
				return false
			}
		case opNotExists:
			if has {
				return false
			}
		case opEquals:
			if !has || v != r.values[0] {
				return false
			}
		case opNotEquals:
			if has && v == r.values[0] {
				return false
			}
		case opIn:
			if !has || !contains(r.values, v) {
				return false
			}
		case opNotIn:
			if has && contains(r.values, v) {
				return false
			}
		}
	}
	return true
}

// String is the selector in canonical form.
func (s Selector) String() string {
	parts := make([]string, len(s))
	for i, r := range s {
		switch r.op {
		case opExists:
			parts[i] = r.key
		case opNotExists:
			parts[i] = "!" + r.key
		case opEquals:
			parts[i] = r.key + "=" + r.values[0]
		case opNotEquals:
			parts[i] = r.key + "!=" + r.values[0]
		case opIn, opNotIn:
			vs := append([]string(nil), r.values...)
			sort.Strings(vs)
			op := " in "
			if r.op == opNotIn {
				op = " notin "
			}
			parts[i] = r.key + op + "(" + strings.Join(vs, ",") + ")"
		}
	}
	return strings.Join(parts, ",")
}

func contains(list []string, v string) bool {
	for _, x := range list {
		if x == v {
			return true
		}
	}
	return false
}
