package buildinfo

import "strings"

// Release returns the MAJOR.MINOR.PATCH release of version as a canonical
// semver ("v1.2.3"), or "" when version is not semantic. A leading "v" is
// optional, surrounding space is ignored, a missing minor or patch is 0,
// and a pre-release or build suffix is dropped: `git describe` stamps
// builds after v1.2.3 as v1.2.3-4-gabcdef, which count as v1.2.3
// (docs/decisions.md). The gateway's --gateway.min-daemon-version and
// doctor's nodes.versions compare daemon versions by it, with
// golang.org/x/mod/semver.Compare.
//
// What is semantic is what golang.org/x/mod/semver accepts (Semantic
// Versioning 2.0.0, plus the vMAJOR and vMAJOR.MINOR shorthands, which take
// no suffix); this package, which every binary links, does not import it,
// and the gateway's tests check that both agree.
func Release(version string) string {
	v := strings.TrimSpace(version)
	if v == "" {
		return ""
	}
	v = strings.TrimPrefix(v, "v")
	major, rest, ok := number(v)
	if !ok {
		return ""
	}
	minor, patch := "0", "0"
	if rest != "" {
		if rest[0] != '.' {
			return ""
		}
		if minor, rest, ok = number(rest[1:]); !ok {
			return ""
		}
	}
	if rest != "" {
		if rest[0] != '.' {
			return ""
		}
		if patch, rest, ok = number(rest[1:]); !ok {
			return ""
		}
		if rest, ok = suffix(rest, '-', true); !ok {
			return ""
		}
		if rest, ok = suffix(rest, '+', false); !ok {
			return ""
		}
	}
	if rest != "" {
		return ""
	}
	return "v" + major + "." + minor + "." + patch
}

// number splits a leading decimal number without leading zeros off v.
func number(v string) (n, rest string, ok bool) {
	i := 0
	for i < len(v) && '0' <= v[i] && v[i] <= '9' {
		i++
	}
	if i == 0 || (v[0] == '0' && i > 1) {
		return "", v, false
	}
	return v[:i], v[i:], true
}

// suffix skips a pre-release ('-', numeric identifiers without leading
// zeros) or build ('+') suffix at the start of v, if there is one: dot
// separated identifiers of [0-9A-Za-z-], none empty. A pre-release ends at
// '+'.
func suffix(v string, mark byte, prerelease bool) (rest string, ok bool) {
	if v == "" || v[0] != mark {
		return v, true
	}
	i := 1
	for i < len(v) && (!prerelease || v[i] != '+') {
		i++
	}
	for _, id := range strings.Split(v[1:i], ".") {
		if id == "" {
			return v, false
		}
		numeric := true
		for j := 0; j < len(id); j++ {
			c := id[j]
			switch {
			case '0' <= c && c <= '9':
			case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', c == '-':
				numeric = false
			default:
				return v, false
			}
		}
		if prerelease && numeric && len(id) > 1 && id[0] == '0' {
			return v, false
		}
	}
	return v[i:], true
}
