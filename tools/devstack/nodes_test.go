package main

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/proctest"
)

// TestWriteCLIContextLeavesOtherContextsAlone calls writeCLIContext, what
// `make run` does once the api is up, with the real CLI on a config file that
// already holds contexts. The promise: the dev context is written, every
// other context stays byte for byte as it was, and dev becomes current only
// when no context is.
func TestWriteCLIContextLeavesOtherContextsAlone(t *testing.T) {
	binDir := t.TempDir()
	require.NoError(t, os.Symlink(proctest.Build(t, "../../services/cli"), filepath.Join(binDir, "leasehold")))

	// Contexts as an operator's file holds them: one with a token file and
	// a CA, one with a token variable.
	const prod = "  prod:\n    api: https://api.example:8443\n    token-file: /etc/leasehold/prod-token\n    ca-file: /etc/leasehold/ca.pem\n"
	const staging = "  staging:\n    api: http://staging.example:8080\n    token-env: LEASEHOLD_STAGING_TOKEN\n"
	for _, c := range []struct {
		name string
		// before is the config file; others are the contexts in it besides
		// dev, which must come out unchanged.
		before      string
		others      map[string]string
		wantCurrent string
	}{
		{
			name:        "another context is current",
			before:      "current-context: prod\ncontexts:\n" + prod + staging,
			others:      map[string]string{"prod": prod, "staging": staging},
			wantCurrent: "prod",
		},
		{
			name:        "no context is current",
			before:      "contexts:\n" + prod + staging,
			others:      map[string]string{"prod": prod, "staging": staging},
			wantCurrent: "dev",
		},
		{
			// make run again, with the api on another port: dev is updated,
			// the current context stays current.
			name:        "dev exists and another context is current",
			before:      "current-context: staging\ncontexts:\n  dev:\n    api: http://127.0.0.1:8080\n    token-file: /old/admin-token\n" + staging,
			others:      map[string]string{"staging": staging},
			wantCurrent: "staging",
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfgPath := filepath.Join(t.TempDir(), "leasehold", "config.yaml")
			require.NoError(t, os.MkdirAll(filepath.Dir(cfgPath), 0o700))
			require.NoError(t, os.WriteFile(cfgPath, []byte(c.before), 0o600))
			t.Setenv("LEASEHOLD_CONFIG", cfgPath)
			for name, block := range c.others {
				require.Equal(t, block, contextBlock(t, c.before, name), "the test's own starting file")
			}

			var logs bytes.Buffer
			stackDir := filepath.Join(t.TempDir(), "dev")
			writeCLIContext(slog.New(slog.NewTextHandler(&logs, nil)), options{dir: stackDir, bin: binDir}, "127.0.0.1:18080")
			require.Contains(t, logs.String(), "leasehold CLI context dev written", logs.String())
			require.NotContains(t, logs.String(), "level=WARN", logs.String())

			b, err := os.ReadFile(cfgPath)
			require.NoError(t, err)
			after := string(b)
			for name, block := range c.others {
				require.Equal(t, block, contextBlock(t, after, name), "context %s changed; the file is now:\n%s", name, after)
			}
			st, err := os.Stat(cfgPath)
			require.NoError(t, err)
			require.Equal(t, os.FileMode(0o600), st.Mode().Perm())

			// What the CLI itself reads from the file now.
			ls := exec.Command(filepath.Join(binDir, "leasehold"), "context", "ls", "-o", "json")
			ls.Env = []string{"PATH=/usr/bin:/bin", "LEASEHOLD_CONFIG=" + cfgPath}
			out, err := ls.CombinedOutput()
			require.NoError(t, err, string(out))
			var doc struct {
				Current  string                       `json:"current-context"`
				Contexts map[string]map[string]string `json:"contexts"`
			}
			require.NoError(t, json.Unmarshal(out, &doc), string(out))
			require.Equal(t, c.wantCurrent, doc.Current, after)
			require.Len(t, doc.Contexts, len(c.others)+1, after)
			require.Equal(t, map[string]string{"api": "http://127.0.0.1:18080", "token-file": filepath.Join(stackDir, "admin-token")},
				doc.Contexts["dev"], after)
			token, err := os.ReadFile(filepath.Join(stackDir, "admin-token"))
			require.NoError(t, err)
			require.Equal(t, apiToken+"\n", string(token))
		})
	}
}

// contextBlock is the text of the context name in a config file as the CLI
// writes it: its "  name:" line and the deeper-indented lines under it.
func contextBlock(t *testing.T, file, name string) string {
	t.Helper()
	lines := strings.SplitAfter(file, "\n")
	for i, l := range lines {
		if l != "  "+name+":\n" {
			continue
		}
		block := l
		for _, more := range lines[i+1:] {
			if !strings.HasPrefix(more, "    ") {
				break
			}
			block += more
		}
		return block
	}
	t.Fatalf("no context %s in:\n%s", name, file)
	return ""
}
