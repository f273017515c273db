package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// runCommandKindExamples runs docs/api.md's "Command kinds" shell block, as
// a reader pastes it after `make run`, against the dev stack the test
// started: the only edits are the api's port and the stack's directory
// (the block names make run's 8080 and ./.dev). Each example's output is
// checked for what the page says it prints.
func runCommandKindExamples(t *testing.T, apiPort int, stackDir string) {
	t.Helper()
	if _, err := exec.LookPath("curl"); err != nil {
		t.Log("curl not installed: docs/api.md's command kind examples are not run")
		return
	}
	doc, err := os.ReadFile(filepath.Join("..", "..", "docs", "api.md"))
	require.NoError(t, err)
	text := string(doc)
	start := strings.Index(text, "\n## Command kinds\n")
	require.GreaterOrEqual(t, start, 0, "docs/api.md has no \"Command kinds\" section")
	text = text[start:]
	open := strings.Index(text, "\n```sh\n")
	require.GreaterOrEqual(t, open, 0, "no sh block in \"Command kinds\"")
	block := text[open+len("\n```sh\n"):]
	end := strings.Index(block, "\n```\n")
	require.GreaterOrEqual(t, end, 0, "the sh block of \"Command kinds\" does not end")
	block = block[:end]
	for old, repl := range map[string]string{
		"http://127.0.0.1:8080/":        fmt.Sprintf("http://127.0.0.1:%d/", apiPort),
		"'$PWD'/.dev/nodes/dev-node-1/": "'" + stackDir + "'/nodes/dev-node-1/",
	} {
		require.Contains(t, block, old, "the examples no longer say %q: update this test with them", old)
		block = strings.ReplaceAll(block, old, repl)
	}
	// The block's last example is a refusal, so bash exits 1 with it: the
	// outputs are what is checked.
	out, _ := exec.Command("bash", "-c", block).CombinedOutput()
	host, err := os.Hostname()
	require.NoError(t, err)
	for _, want := range []string{
		`"state":"COMMAND_STATE_SUCCEEDED"`, // the first command, waited for
		"hello from " + host,                // exec with env
		"line 3",                            // script
		`"sha256":"`,                        // file.put, then file.get
		`"hostname":"` + host + `"`,         // facts
		"reboot_not_allowed",                // reboot without --allow-reboot
		"payload.argv: must not be empty",   // the api's refusal
	} {
		require.Contains(t, string(out), want, "docs/api.md's command kind examples printed:\n%s", out)
	}
}
