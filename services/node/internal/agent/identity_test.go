package agent

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// Machine ids as systemd writes them: 32 hex digits.
const (
	machineID      = "0123456789abcdef0123456789abcdef"
	otherMachineID = "fedcba9876543210fedcba9876543210"
)

// absent stands for a machine-id file that does not exist.
const absent = "\x00absent"

// machineIDFilesOf writes each content to a file of its own (none for
// absent) and returns their paths, in order.
func machineIDFilesOf(t *testing.T, contents ...string) []string {
	t.Helper()
	dir := t.TempDir()
	paths := make([]string, len(contents))
	for i, c := range contents {
		paths[i] = filepath.Join(dir, "machine-id-"+string(rune('a'+i)))
		if c != absent {
			require.NoError(t, os.WriteFile(paths[i], []byte(c), 0o600))
		}
	}
	return paths
}

// hostnameOf is a hostname function that answers name.
func hostnameOf(name string) func() (string, error) {
	return func() (string, error) { return name, nil }
}

// noHostname is a hostname function that fails.
func noHostname() (string, error) { return "", errors.New("uname failed") }

// TestDefaultNodeID covers the order DefaultNodeID asks in: the state
// directory's node-id file, then the short hostname (skipped when it is
// "localhost", not a valid node id or unknown), then the machine-id files
// in order (skipping a missing or unusable one); with none of them usable
// the error names --node-id, the flag to set.
func TestDefaultNodeID(t *testing.T) {
	for _, c := range []struct {
		name     string
		joined   string // the state directory's node-id file; empty: none
		hostname func() (string, error)
		machine  []string // contents of the machine-id files, in order
		want     string
	}{
		{"the joined id wins over the hostname and the machine id", "joined-7\n", hostnameOf("web-01"), []string{machineID}, "joined-7"},
		{"the short hostname wins over the machine id", "", hostnameOf("web-01.dc1.example.com"), []string{machineID}, "web-01"},
		{"localhost is skipped", "", hostnameOf("localhost"), []string{machineID + "\n"}, machineID},
		{"localhost with a domain is skipped", "", hostnameOf("localhost.localdomain"), []string{machineID}, machineID},
		{"a hostname that is not a valid node id is skipped", "", hostnameOf("web 01"), []string{machineID}, machineID},
		{"an unknown hostname is skipped", "", noHostname, []string{machineID}, machineID},
		{"a missing first machine-id file falls back to the second", "", noHostname, []string{absent, otherMachineID}, otherMachineID},
		{"an empty first machine-id file (an uninitialised image) falls back to the second", "", hostnameOf("localhost"),
			[]string{"\n", otherMachineID}, otherMachineID},
		{"the first machine-id file wins over the second", "", noHostname, []string{machineID, otherMachineID}, machineID},
	} {
		t.Run(c.name, func(t *testing.T) {
			state := t.TempDir()
			if c.joined != "" {
				require.NoError(t, os.WriteFile(filepath.Join(state, nodeIDFileName), []byte(c.joined), 0o600))
			}
			got, err := defaultNodeID(state, c.hostname, machineIDFilesOf(t, c.machine...))
			require.NoError(t, err)
			require.Equal(t, c.want, got)
		})
	}

	t.Run("nothing usable: the error names --node-id", func(t *testing.T) {
		for _, hostname := range []func() (string, error){noHostname, hostnameOf("localhost"), hostnameOf("")} {
			_, err := defaultNodeID(t.TempDir(), hostname, machineIDFilesOf(t, absent, ""))
			require.ErrorContains(t, err, "give --node-id")
		}
	})

	t.Run("an invalid joined id is refused, naming the file, not replaced by the hostname", func(t *testing.T) {
		state := t.TempDir()
		path := filepath.Join(state, nodeIDFileName)
		require.NoError(t, os.WriteFile(path, []byte("not a node id\n"), 0o600))
		_, err := defaultNodeID(state, hostnameOf("web-01"), machineIDFilesOf(t, machineID))
		require.ErrorContains(t, err, path)
	})

	t.Run("an unreadable joined id is an error, not replaced by the hostname", func(t *testing.T) {
		state := t.TempDir()
		require.NoError(t, os.Mkdir(filepath.Join(state, nodeIDFileName), 0o700)) // reading a directory fails
		_, err := defaultNodeID(state, hostnameOf("web-01"), machineIDFilesOf(t, machineID))
		require.ErrorContains(t, err, "read the node id")
	})

	t.Run("Resolve names --node-id when DefaultNodeID fails", func(t *testing.T) {
		state := t.TempDir()
		require.NoError(t, os.WriteFile(filepath.Join(state, nodeIDFileName), []byte("not a node id\n"), 0o600))
		c := Config{StateDir: state}
		require.ErrorContains(t, c.Resolve(), "--node-id: ")
	})
}
