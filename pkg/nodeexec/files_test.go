package nodeexec

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

func sha(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

func putPayload(t *testing.T, fields map[string]any) string {
	t.Helper()
	return mustJSON(t, fields)
}

// dirEntries lists a directory's names, so a test can see that nothing
// (no temporary file) was left.
func dirEntries(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	require.NoError(t, err)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return names
}

func rootedExecutor(t *testing.T, mutate ...func(*Config)) (*Executor, string) {
	t.Helper()
	root := t.TempDir()
	return newExecutor(t, append([]func(*Config){func(c *Config) { c.FileRoots = []string{root} }}, mutate...)...), root
}

// TestFilePutGetRoundTrip: bytes and mode written by file.put are what
// file.get streams back, byte for byte, with the same sha256.
func TestFilePutGetRoundTrip(t *testing.T) {
	t.Parallel()
	e, root := rootedExecutor(t)
	content := make([]byte, 300_000)
	_, _ = rand.Read(content)
	path := filepath.Join(root, "sub", "blob.bin")
	o, _ := handle(t, e, "file.put", putPayload(t, map[string]any{"path": path, "content": content, "mode": 0o640,
		"sha256": sha(content), "makeDirs": true}))
	require.Equal(t, int32(0), o.ExitCode, o.Err)
	require.Empty(t, o.Err)
	var put FileInfo
	require.NoError(t, json.Unmarshal(o.Output, &put))
	require.Equal(t, FileInfo{Path: path, Size: int64(len(content)), Mode: "0640", SHA256: sha(content)}, put)
	got, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Equal(t, content, got)
	fi, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o640), fi.Mode().Perm())
	require.Equal(t, []string{"blob.bin"}, dirEntries(t, filepath.Dir(path)), "no temporary file left")

	o, r := handle(t, e, "file.get", mustJSON(t, map[string]any{"path": path}))
	require.Equal(t, int32(0), o.ExitCode, o.Err)
	var get FileInfo
	require.NoError(t, json.Unmarshal(o.Output, &get))
	require.Equal(t, put, get)
	require.Equal(t, content, r.stdout.Bytes(), "the content is the live stdout")

	// Overwriting replaces it; mode 0 means 0644; setuid bits are kept.
	o, _ = handle(t, e, "file.put", putPayload(t, map[string]any{"path": path, "content": []byte("new")}))
	require.Equal(t, int32(0), o.ExitCode, o.Err)
	got, err = os.ReadFile(path)
	require.NoError(t, err)
	require.Equal(t, "new", string(got))
	fi, err = os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o644), fi.Mode().Perm())
	o, _ = handle(t, e, "file.put", putPayload(t, map[string]any{"path": path, "content": []byte("x"), "mode": 0o4755}))
	require.Equal(t, int32(0), o.ExitCode, o.Err)
	require.NoError(t, json.Unmarshal(o.Output, &put))
	require.Equal(t, "4755", put.Mode)
}

// TestFilePutFailuresLeaveNothing: every refused or failed file.put
// leaves the directory as it was: no temporary file, the old file intact.
func TestFilePutFailuresLeaveNothing(t *testing.T) {
	t.Parallel()
	e, root := rootedExecutor(t, func(c *Config) { c.FileMaxBytes = 1000 })
	outside := t.TempDir()
	require.NoError(t, os.Symlink(outside, filepath.Join(root, "link")))
	require.NoError(t, os.Mkdir(filepath.Join(root, "adir"), 0o755))
	existing := filepath.Join(root, "keep")
	require.NoError(t, os.WriteFile(existing, []byte("old"), 0o600))
	cases := []struct {
		name   string
		fields map[string]any
		code   string
	}{
		{"checksum mismatch", map[string]any{"path": existing, "content": []byte("new"), "sha256": sha([]byte("other"))}, "checksum_mismatch: "},
		{"too large", map[string]any{"path": existing, "content": make([]byte, 1001)}, "file_too_large: "},
		{"outside the roots", map[string]any{"path": filepath.Join(outside, "x"), "content": []byte("x")}, "path_not_allowed: "},
		{"through a symlink out of the roots", map[string]any{"path": filepath.Join(root, "link", "x"), "content": []byte("x")}, "path_not_allowed: "},
		{"through a symlink, creating dirs", map[string]any{"path": filepath.Join(root, "link", "a", "b"), "content": []byte("x"), "makeDirs": true}, "path_not_allowed: "},
		{"missing directory", map[string]any{"path": filepath.Join(root, "nodir", "x"), "content": []byte("x")}, "not_found: "},
		{"a directory", map[string]any{"path": filepath.Join(root, "adir"), "content": []byte("x")}, "not_regular_file: "},
		{"unknown owner", map[string]any{"path": existing, "content": []byte("x"), "owner": "no-such-user-leasehold"}, "user_not_found: "},
		{"unknown group", map[string]any{"path": existing, "content": []byte("x"), "group": "no-such-group-leasehold"}, "group_not_found: "},
	}
	for _, c := range cases {
		o, _ := handle(t, e, "file.put", putPayload(t, c.fields))
		require.Equal(t, int32(-1), o.ExitCode, c.name)
		require.True(t, strings.HasPrefix(o.Err, c.code), "%s: %q", c.name, o.Err)
		require.Contains(t, o.Err, "file.put "+c.fields["path"].(string)+": ", c.name)
		require.ElementsMatch(t, []string{"link", "adir", "keep"}, dirEntries(t, root), c.name)
		require.Empty(t, dirEntries(t, outside), c.name)
		require.Empty(t, dirEntries(t, filepath.Join(root, "adir")), c.name)
		got, err := os.ReadFile(existing)
		require.NoError(t, err)
		require.Equal(t, "old", string(got), c.name)
	}
}

func TestFileKindsWithoutRoots(t *testing.T) {
	t.Parallel()
	e := newExecutor(t)
	dir := t.TempDir()
	o, _ := handle(t, e, "file.put", putPayload(t, map[string]any{"path": filepath.Join(dir, "x"), "content": []byte("x")}))
	require.Equal(t, int32(-1), o.ExitCode)
	require.Equal(t, "path_not_allowed: file.put "+filepath.Join(dir, "x")+": file commands are refused on this node: no --file.roots configured", o.Err)
	require.Empty(t, dirEntries(t, dir))
	o, _ = handle(t, e, "file.get", mustJSON(t, map[string]any{"path": "/etc/hostname"}))
	require.Equal(t, int32(-1), o.ExitCode)
	require.True(t, strings.HasPrefix(o.Err, "path_not_allowed: "), o.Err)
	require.Contains(t, o.Err, "--file.roots")
}

func TestFileGetRefusals(t *testing.T) {
	t.Parallel()
	e, root := rootedExecutor(t, func(c *Config) { c.FileMaxBytes = 10 })
	outside := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(outside, "secret"), []byte("s"), 0o600))
	require.NoError(t, os.Symlink(filepath.Join(outside, "secret"), filepath.Join(root, "link")))
	require.NoError(t, os.WriteFile(filepath.Join(root, "big"), make([]byte, 11), 0o600))
	require.NoError(t, syscall.Mkfifo(filepath.Join(root, "fifo"), 0o600))
	for _, c := range []struct{ path, code string }{
		{filepath.Join(root, "fifo"), "not_regular_file: "},
		{filepath.Join(root, "missing"), "not_found: "},
		{filepath.Join(outside, "secret"), "path_not_allowed: "},
		{filepath.Join(root, "link"), "path_not_allowed: "},
		{filepath.Join(root, "big"), "file_too_large: "},
		{root, "not_regular_file: "},
	} {
		o, r := handle(t, e, "file.get", mustJSON(t, map[string]any{"path": c.path}))
		require.Equal(t, int32(-1), o.ExitCode, c.path)
		require.True(t, strings.HasPrefix(o.Err, c.code+"file.get "+c.path+": "), "%s: %q", c.path, o.Err)
		require.Empty(t, r.stdout.String(), c.path)
	}
}

// TestFilePutOwner: as root the file gets the named owner and group; as
// anyone else a chown to another user is refused, saying root is needed.
func TestFilePutOwner(t *testing.T) {
	t.Parallel()
	e, root := rootedExecutor(t)
	path := filepath.Join(root, "owned")
	o, _ := handle(t, e, "file.put", putPayload(t, map[string]any{"path": path, "content": []byte("x"), "owner": "65534", "group": "65534"}))
	if os.Geteuid() != 0 {
		require.Equal(t, int32(-1), o.ExitCode)
		require.True(t, strings.HasPrefix(o.Err, "permission_denied: "), o.Err)
		require.Empty(t, dirEntries(t, root))
		return
	}
	require.Equal(t, int32(0), o.ExitCode, o.Err)
	fi, err := os.Stat(path)
	require.NoError(t, err)
	st := fi.Sys().(*syscall.Stat_t)
	require.Equal(t, uint32(65534), st.Uid)
	require.Equal(t, uint32(65534), st.Gid)
}
