package relaytoken

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/pkg/reload"
)

func TestWatchReadsTheFile(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	read := func(path string) (string, error) {
		tok, err := Watch("test-"+filepath.Base(path), "--x.token-file", path, reload.Options{})
		if err != nil {
			return "", err
		}
		return tok.Value(), nil
	}

	tok, err := read(write("ok", "  0123456789abcdef\n"))
	if err != nil || tok != "0123456789abcdef" {
		t.Fatalf("Watch = %q, %v; want the trimmed token", tok, err)
	}

	_, err = read(write("short", "0123456789abcde\n"))
	if err == nil || !strings.Contains(err.Error(), "--x.token-file") || !strings.Contains(err.Error(), "at least 16") {
		t.Fatalf("a 15-character token: err = %v; want a refusal naming the flag and the minimum", err)
	}

	_, err = read(filepath.Join(dir, "missing"))
	if err == nil || !strings.HasPrefix(err.Error(), "--x.token-file: ") {
		t.Fatalf("a missing file: err = %v; want an error naming the flag", err)
	}
}
