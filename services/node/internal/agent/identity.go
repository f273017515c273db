package agent

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/leasehold/leasehold/pkg/nodeauth"
)

// File names under the state directory.
const (
	// credentialFileName holds the node's credential (0600).
	credentialFileName = "credential"
	// nodeIDFileName holds the node id the machine joined as.
	nodeIDFileName = "node-id"
	// journalFileName is the durable journal of started and finished commands.
	journalFileName = "journal"
)

// DefaultNodeID is the id a machine asks for when none is given: the id it
// joined as (the state directory's node-id file), else its short hostname
// when that is a valid node id other than "localhost", else its machine id
// (/etc/machine-id, else /var/lib/dbus/machine-id). Operators type node ids, so the hostname comes before
// the machine id; a hostname shared by several machines (a fresh image's
// "localhost") would make them one node, so it is skipped.
func DefaultNodeID(stateDir string) (string, error) {
	return defaultNodeID(stateDir, os.Hostname, machineIDFiles)
}

// machineIDFiles are where DefaultNodeID reads the machine id, in order.
var machineIDFiles = []string{"/etc/machine-id", "/var/lib/dbus/machine-id"}

// defaultNodeID is DefaultNodeID with the hostname and the machine-id files
// given, so tests can choose what the machine looks like.
func defaultNodeID(stateDir string, hostname func() (string, error), machineIDPaths []string) (string, error) {
	if b, err := os.ReadFile(filepath.Join(stateDir, nodeIDFileName)); err == nil {
		id := strings.TrimSpace(string(b))
		if err := nodeauth.ValidateNodeID(id); err != nil {
			return "", fmt.Errorf("%s: %w", filepath.Join(stateDir, nodeIDFileName), err)
		}
		return id, nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("read the node id: %w", err)
	}
	if h, err := hostname(); err == nil {
		h, _, _ = strings.Cut(h, ".")
		if h != "" && h != "localhost" && nodeauth.ValidateNodeID(h) == nil {
			return h, nil
		}
	}
	for _, p := range machineIDPaths {
		if b, err := os.ReadFile(p); err == nil {
			if id := strings.TrimSpace(string(b)); nodeauth.ValidateNodeID(id) == nil {
				return id, nil
			}
		}
	}
	return "", fmt.Errorf("no node id: give --node-id (the hostname is not usable and no machine-id file holds a usable id: %s)", strings.Join(machineIDPaths, ", "))
}

// ReadCredential reads the credential file at path. It refuses a file that
// group or others may read or write, naming the file, because the
// credential lets anyone holding it act as this node.
func ReadCredential(path string) (string, error) {
	st, err := os.Stat(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return "", fmt.Errorf("credential file %s does not exist: run `leasehold-node join` first (or give --node-credential-file)", path)
		}
		return "", fmt.Errorf("credential file %s: %w", path, err)
	}
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		return "", fmt.Errorf("credential file %s has mode %04o: it must not be readable or writable by group or others (chmod 600 %s)", path, perm, path)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("credential file %s: %w", path, err)
	}
	cred := strings.TrimSpace(string(b))
	if cred == "" {
		return "", fmt.Errorf("credential file %s is empty", path)
	}
	return cred, nil
}

// writeFileAtomic writes b to path with mode perm: a temporary file in the
// same directory, fsynced, renamed over path, and the directory fsynced,
// so a crash leaves the old file or the new one, never a torn one.
func writeFileAtomic(path string, b []byte, perm os.FileMode) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	tmp := f.Name()
	defer func() { _ = os.Remove(tmp) }() // a no-op once renamed
	if err := f.Chmod(perm); err != nil {
		_ = f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if _, err := f.Write(b); err != nil {
		_ = f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		_ = f.Close()
		return fmt.Errorf("write %s: fsync: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("write %s: open directory: %w", path, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("write %s: fsync directory: %w", path, err)
	}
	return nil
}

// ensureStateDir creates dir (0700) when missing and refuses one that
// others may write to.
func ensureStateDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("state directory %s: %w", dir, err)
	}
	st, err := os.Stat(dir)
	if err != nil {
		return fmt.Errorf("state directory %s: %w", dir, err)
	}
	if !st.IsDir() {
		return fmt.Errorf("state directory %s is not a directory", dir)
	}
	if st.Mode().Perm()&0o022 != 0 {
		return fmt.Errorf("state directory %s has mode %04o: group or others may write to it (chmod 700 %s)", dir, st.Mode().Perm(), dir)
	}
	return nil
}
