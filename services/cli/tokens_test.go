package main_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/pkg/apiauth"
)

// TestTokensCreate: `leasehold tokens create --role R` needs no context
// and prints a new token and the tokens-file line that grants it R (the
// api's own parser accepts the line and authenticates the token with that
// role); -o json carries the same; a missing or unknown role is bad usage
// naming --role.
func TestTokensCreate(t *testing.T) {
	t.Parallel()
	e := newCLIEnv(t)

	r := e.run(t, "tokens", "create", "--role", "operator")
	requireCode(t, r, 0)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[0], apiauth.TokenPrefix) || !strings.HasPrefix(lines[1], "operator:sha256:") {
		t.Fatalf("want a token and its tokens-file line, got:\n%s", r.stdout)
	}
	keys, err := apiauth.LoadContents("tokens file", []byte(lines[1]+"\n"), "", "")
	if err != nil {
		t.Fatalf("the api refuses the printed line %q: %v", lines[1], err)
	}
	id, ok := keys.Authenticate(lines[0])
	if !ok || id.Role.String() != "operator" {
		t.Fatalf("the printed token does not authenticate as operator: %+v %v", id, ok)
	}
	again := e.run(t, "tokens", "create", "--role", "operator")
	requireCode(t, again, 0)
	if strings.Split(again.stdout, "\n")[0] == lines[0] {
		t.Fatal("two runs printed the same token")
	}

	r = e.run(t, "tokens", "create", "--role", "admin", "-o", "json")
	requireCode(t, r, 0)
	var doc struct{ Token, Role, TokensFileLine string }
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil {
		t.Fatalf("-o json: %v\n%s", err, r.stdout)
	}
	if doc.Role != "admin" || doc.TokensFileLine != apiauth.ConfigLine(apiauth.RoleAdmin, doc.Token) {
		t.Fatalf("-o json: %+v", doc)
	}

	for args, want := range map[string]string{
		"tokens create":                "--role is required",
		"tokens create --role boss":    `--role "boss"`,
		"tokens create --role admin x": "no arguments",
	} {
		r := e.run(t, strings.Fields(args)...)
		requireCode(t, r, 2)
		requireContains(t, r.stderr, want)
	}
}
