package main

import (
	"os"
	"path/filepath"
	"testing"
)

func TestAnchor(t *testing.T) {
	for in, want := range map[string]string{
		"Quick start on the dev stack":   "quick-start-on-the-dev-stack",
		"`leasehold-node`: the agent":    "leasehold-node-the-agent",
		"Runs (one command, many nodes)": "runs-one-command-many-nodes",
		"Tokens files that do not parse": "tokens-files-that-do-not-parse",
		"A/B: 1,250/s":                   "ab-1250s",
	} {
		if got := Anchor(in); got != want {
			t.Errorf("Anchor(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestCheckFindsBrokenLinks: a missing file and a missing heading are
// reported; links inside code, absolute URLs and good links are not.
func TestCheckFindsBrokenLinks(t *testing.T) {
	root := t.TempDir()
	write := func(name, s string) {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(root, name)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, name), []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("docs/a.md", "# A\n\n## Same\n\n## Same\n\ntext\n")
	write("README.md", "[ok](docs/a.md#same-1) [ok2](docs/a.md) [web](https://example.org/x#y) `[code](nowhere.md)`\n"+
		"```\n[fenced](nowhere.md)\n```\n[bad file](docs/b.md) [bad anchor](docs/a.md#other) [self](#a)\n")
	broken, err := check(root, []string{"README.md", "docs/a.md"})
	if err != nil {
		t.Fatal(err)
	}
	if len(broken) != 3 {
		t.Fatalf("broken = %q, want the missing file, the missing anchor and the self link", broken)
	}
}
