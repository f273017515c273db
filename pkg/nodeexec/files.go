package nodeexec

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/leasehold/leasehold/pkg/daemon"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// FileInfo is the result Output of file.put and file.get: the file as it
// is on the node after the command. Mode is octal text ("0644").
type FileInfo struct {
	Path   string `json:"path"`
	Size   int64  `json:"size"`
	Mode   string `json:"mode"`
	SHA256 string `json:"sha256"`
}

// allowed refuses a path outside the roots. p is absolute and clean.
func (e *Executor) allowed(p string) error {
	if len(e.roots) == 0 {
		return coded(CodePathNotAllowed, "file commands are refused on this node: no --file.roots configured")
	}
	for _, r := range e.roots {
		if r == "/" || p == r || strings.HasPrefix(p, r+"/") {
			return nil
		}
	}
	return coded(CodePathNotAllowed, "%s is outside --file.roots (%s)", p, strings.Join(e.cfg.FileRoots, ","))
}

// allowedResolved checks p both as written and with its symlinks resolved,
// so a link inside a root cannot lead outside it. p's deepest existing
// ancestor is what is resolved when p does not exist (yet).
func (e *Executor) allowedResolved(p string) error {
	if err := e.allowed(p); err != nil {
		return err
	}
	existing, rest := p, ""
	for {
		real, err := filepath.EvalSymlinks(existing)
		if err == nil {
			return e.allowed(filepath.Join(real, rest))
		}
		if !errors.Is(err, fs.ErrNotExist) || existing == "/" {
			return fmt.Errorf("resolve %s: %w", existing, err)
		}
		rest = filepath.Join(filepath.Base(existing), rest)
		existing = filepath.Dir(existing)
	}
}

// modeText is a mode's permission bits with setuid, setgid and sticky, in
// octal as chmod takes it ("0644", "4755").
func modeText(m fs.FileMode) string {
	v := uint32(m.Perm())
	if m&fs.ModeSetuid != 0 {
		v |= 0o4000
	}
	if m&fs.ModeSetgid != 0 {
		v |= 0o2000
	}
	if m&fs.ModeSticky != 0 {
		v |= 0o1000
	}
	return fmt.Sprintf("%04o", v)
}

// unixMode is the permission bits and setuid/setgid/sticky of a payload's
// mode as an fs.FileMode.
func unixMode(m uint32) fs.FileMode {
	mode := fs.FileMode(m & 0o777)
	if m&0o4000 != 0 {
		mode |= fs.ModeSetuid
	}
	if m&0o2000 != 0 {
		mode |= fs.ModeSetgid
	}
	if m&0o1000 != 0 {
		mode |= fs.ModeSticky
	}
	return mode
}

// filePut writes a file atomically: a temporary file in the same
// directory is written, fsynced, given its mode and owner, checked against
// the sha256, renamed over the path, and the directory fsynced. On any
// failure the temporary file is removed and the path is untouched.
func (e *Executor) filePut(log *slog.Logger, p *nodev1.FilePutPayload) daemon.Outcome {
	path := p.GetPath()
	if err := e.filePutErr(log, p); err != nil {
		return outcomeOf(fmt.Errorf("file.put %s: %w", path, err))
	}
	fi, err := os.Stat(path)
	if err != nil {
		return outcomeOf(fmt.Errorf("file.put %s: %w", path, err))
	}
	sum := sha256.Sum256(p.GetContent())
	return jsonOutput(FileInfo{Path: path, Size: fi.Size(), Mode: modeText(fi.Mode()), SHA256: hex.EncodeToString(sum[:])})
}

func (e *Executor) filePutErr(log *slog.Logger, p *nodev1.FilePutPayload) (err error) {
	path, content := p.GetPath(), p.GetContent()
	if int64(len(content)) > e.cfg.FileMaxBytes {
		return coded(CodeFileTooLarge, "%d bytes, more than --file.max-bytes %d", len(content), e.cfg.FileMaxBytes)
	}
	if err := e.allowedResolved(path); err != nil {
		return err
	}
	uid, gid := -1, -1
	if o := p.GetOwner(); o != "" {
		id, err := lookupUser(o)
		if err != nil {
			return err
		}
		uid = int(id.uid)
	}
	if g := p.GetGroup(); g != "" {
		n, err := lookupGroup(g)
		if err != nil {
			return err
		}
		gid = int(n)
	}
	dir := filepath.Dir(path)
	if fi, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
		if !p.GetMakeDirs() {
			return coded(CodeNotFound, "directory %s does not exist (set make_dirs to create it)", dir)
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("create directory %s: %w", dir, err)
		}
	} else if err != nil {
		return fmt.Errorf("directory %s: %w", dir, err)
	} else if !fi.IsDir() {
		return coded(CodeNotFound, "%s is not a directory", dir)
	}
	// Resolved again now the directory exists: MkdirAll may have followed
	// a link.
	if err := e.allowedResolved(path); err != nil {
		return err
	}
	if fi, err := os.Lstat(path); err == nil && !fi.Mode().IsRegular() && fi.Mode()&fs.ModeSymlink == 0 {
		return coded(CodeNotRegularFile, "%s exists and is a %s", path, fi.Mode().Type())
	}

	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".leasehold-*")
	if err != nil {
		return fmt.Errorf("create temporary file: %w", err)
	}
	tmpName := tmp.Name()
	defer func() {
		if err != nil {
			_ = tmp.Close()
			if rerr := os.Remove(tmpName); rerr != nil && !errors.Is(rerr, fs.ErrNotExist) {
				log.Error("file.put: remove temporary file", "file", tmpName, "err", rerr)
			}
		}
	}()
	if _, err := tmp.Write(content); err != nil {
		return fmt.Errorf("write %s: %w", tmpName, err)
	}
	if err := tmp.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", tmpName, err)
	}
	mode := p.GetMode()
	if mode == 0 {
		mode = 0o644
	}
	if err := tmp.Chmod(unixMode(mode)); err != nil {
		return fmt.Errorf("chmod %s: %w", tmpName, err)
	}
	if uid != -1 || gid != -1 {
		if err := tmp.Chown(uid, gid); err != nil {
			if errors.Is(err, fs.ErrPermission) {
				return coded(CodePermissionDenied, "chown to owner %q group %q needs leasehold-node to run as root: %v", p.GetOwner(), p.GetGroup(), err)
			}
			return fmt.Errorf("chown %s: %w", tmpName, err)
		}
	}
	// What is on disk is what is checked, not what was meant to be written.
	if _, err := tmp.Seek(0, io.SeekStart); err != nil {
		return fmt.Errorf("read back %s: %w", tmpName, err)
	}
	h := sha256.New()
	if _, err := io.Copy(h, tmp); err != nil {
		return fmt.Errorf("read back %s: %w", tmpName, err)
	}
	want := p.GetSha256()
	if want == "" {
		s := sha256.Sum256(content)
		want = hex.EncodeToString(s[:])
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != want {
		return coded(CodeChecksumMismatch, "the content written has SHA-256 %s, the payload says %s", got, want)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("close %s: %w", tmpName, err)
	}
	if err := os.Rename(tmpName, path); err != nil {
		return fmt.Errorf("rename %s: %w", tmpName, err)
	}
	// The rename is durable once the directory is.
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("open directory %s: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync directory %s: %w", dir, err)
	}
	return nil
}

// fileGet streams a file to the command's stdout (live output) and reports
// its path, size, mode and sha256 as the result.
func (e *Executor) fileGet(ctx context.Context, p *nodev1.FileGetPayload) daemon.Outcome {
	path := p.GetPath()
	info, err := e.fileGetErr(ctx, path)
	if err != nil {
		return outcomeOf(fmt.Errorf("file.get %s: %w", path, err))
	}
	return jsonOutput(info)
}

func (e *Executor) fileGetErr(ctx context.Context, path string) (FileInfo, error) {
	if err := e.allowedResolved(path); err != nil {
		return FileInfo{}, err
	}
	// O_NONBLOCK: opening a FIFO must not wait for a writer; on a regular
	// file it changes nothing.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOCTTY, 0)
	if err != nil {
		return FileInfo{}, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return FileInfo{}, err
	}
	if !fi.Mode().IsRegular() {
		return FileInfo{}, coded(CodeNotRegularFile, "it is a %s", fi.Mode().Type())
	}
	if fi.Size() > e.cfg.FileMaxBytes {
		return FileInfo{}, coded(CodeFileTooLarge, "%d bytes, more than --file.max-bytes %d", fi.Size(), e.cfg.FileMaxBytes)
	}
	h := sha256.New()
	// A file growing while it is read is cut at the limit.
	n, err := io.Copy(io.MultiWriter(h, daemon.Stdout(ctx)), io.LimitReader(f, e.cfg.FileMaxBytes))
	if err != nil {
		return FileInfo{}, fmt.Errorf("read: %w", err)
	}
	return FileInfo{Path: path, Size: n, Mode: modeText(fi.Mode()), SHA256: hex.EncodeToString(h.Sum(nil))}, nil
}
