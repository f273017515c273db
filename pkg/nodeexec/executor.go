// Package nodeexec executes the typed command kinds (pkg/cmdkind) on a
// node: its Executor.Handle is a daemon.Handler.
//
// What an operator can rely on:
//   - exec and script run without a shell, each in a process group of its
//     own, as the requested user; stdout and stderr stream live, and the
//     result keeps the last ResultTailBytes of both, marked when more was
//     produced.
//   - cancel and timeout send SIGTERM to the whole group, then SIGKILL after
//     Config.KillGrace; processes left in the group after the main process
//     exited are stopped the same way, so none outlives its command.
//   - on Linux with a cgroup v2 of the agent's own (Config.Cgroup), each
//     exec and script command also runs in a cgroup of its own, which it
//     starts in (clone3): processes that left the group (setsid) get the
//     SIGTERM too and are killed with the rest (cgroup.kill), and the
//     cgroup is removed once empty. Elsewhere a process that calls setsid
//     escapes its command.
//   - at most Config.MaxConcurrent exec and script commands run at once; the
//     rest wait on the node and can be cancelled while they wait.
//   - file.put is atomic and leaves nothing behind on failure; file kinds
//     touch only files inside Config.FileRoots.
//   - reboot happens only with Config.AllowReboot, after the result.
//
// A command that cannot run for a reason the api could not know reports
// exit code -1 and an Err starting with a stable code ("user_not_found: …");
// the codes are the Code* constants.
package nodeexec

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/leasehold/leasehold/pkg/buildinfo"
	"github.com/leasehold/leasehold/pkg/cmdkind"
	"github.com/leasehold/leasehold/pkg/daemon"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// The codes an Outcome's Err starts with ("<code>: <detail>") when the
// command could not run; its ExitCode is then -1.
const (
	// CodeUnknownKind: the kind is not a typed kind (cmdkind.Kinds).
	CodeUnknownKind = "unknown_kind"
	// CodeInvalidPayload: the payload does not parse or validate (the api
	// refuses these at CreateCommand; a command written another way can
	// still carry one).
	CodeInvalidPayload = "invalid_payload"
	// CodeUserNotFound and CodeGroupNotFound: the node has no such user or
	// group.
	CodeUserNotFound  = "user_not_found"
	CodeGroupNotFound = "group_not_found"
	// CodePermissionDenied: the agent lacks a privilege the command needs
	// (running as another user or changing a file's owner needs root), or
	// the operating system refused an operation.
	CodePermissionDenied = "permission_denied"
	// CodeNotFound: a program, interpreter, directory or file does not
	// exist.
	CodeNotFound = "not_found"
	// CodePathNotAllowed: a file path outside --file.roots (or no roots are
	// configured).
	CodePathNotAllowed = "path_not_allowed"
	// CodeNotRegularFile: file.put or file.get on something that is not a
	// regular file (a directory, a device).
	CodeNotRegularFile = "not_regular_file"
	// CodeFileTooLarge: content or file over --file.max-bytes.
	CodeFileTooLarge = "file_too_large"
	// CodeChecksumMismatch: the bytes written do not have the payload's
	// sha256.
	CodeChecksumMismatch = "checksum_mismatch"
	// CodeRebootNotAllowed: reboot without --allow-reboot.
	CodeRebootNotAllowed = "reboot_not_allowed"
	// CodeStartFailed: the process could not be started for another reason.
	CodeStartFailed = "start_failed"
	// CodeIOError: reading or writing a file failed.
	CodeIOError = "io_error"
)

// Executor runs typed commands on this node. It is safe for concurrent
// use; Handle is a daemon.Handler.
type Executor struct {
	cfg   Config
	roots []string // FileRoots with symlinks resolved
	log   *slog.Logger
	slots chan struct{}
	// cg is the cgroup under which each command gets one of its own; nil:
	// process groups only.
	cg *cgroupRoot

	closing   chan struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup
	rebootMu  sync.Mutex
	rebootAt  time.Time // a scheduled reboot, zero when none
}

// New validates cfg and returns an Executor. A nil logger discards.
//
// Unless cfg.Cgroup is CgroupOff it sets up cgroups on Linux: it checks
// the agent's cgroup v2 (CheckCgroups), kills and removes the command
// cgroups a killed agent left in it, and moves the agent into the leaf
// "agent" below it. Where that fails, commands run in process groups only
// and New logs why at info, or fails with CgroupRequired.
func New(cfg Config, logger *slog.Logger) (*Executor, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("nodeexec: %w", err)
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Version == "" {
		cfg.Version = buildinfo.Version()
	}
	e := &Executor{cfg: cfg, log: logger, slots: make(chan struct{}, cfg.MaxConcurrent), closing: make(chan struct{})}
	switch cfg.Cgroup {
	case CgroupOff:
		logger.Info("commands run in their process groups only (exec.cgroup=off)")
	default:
		root, err := setupCgroups(cfg.cgroupPaths, logger)
		switch {
		case err == nil:
			e.cg = root
			logger.Info("each exec and script command runs in a cgroup of its own", "cgroup", root.dir, "agent", root.dir+"/"+cgroupLeaf)
		case cfg.Cgroup == CgroupRequired:
			return nil, fmt.Errorf("nodeexec: exec.cgroup=required: %w", err)
		default:
			logger.Info("commands run in their process groups only, without cgroups: a process that calls setsid escapes its command (exec.cgroup=auto)", "reason", err.Error())
		}
	}
	for _, r := range cfg.FileRoots {
		// A root reached through a symlink is compared by its target, as
		// the paths checked against it are.
		if real, err := filepath.EvalSymlinks(r); err == nil {
			r = real
		}
		e.roots = append(e.roots, r)
	}
	return e, nil
}

// CheckCgroups reports why exec and script commands could not run in
// cgroups of their own on this machine, or nil when they can: cgroup2
// mounted, the agent alone in its cgroup, a cgroup made there, cgroup.kill
// in it (Linux 5.14), and a process started in it. It changes nothing but
// an empty probe cgroup it makes and removes.
func CheckCgroups(cfg Config) error {
	_, _, err := probeCgroups(cfg.cgroupPaths)
	return err
}

// Close cancels a reboot that has not started yet and waits for the
// executor's own goroutines; running commands end with their contexts.
func (e *Executor) Close() {
	e.closeOnce.Do(func() { close(e.closing) })
	e.wg.Wait()
}

// Handle executes cmd and reports how it ended. It returns promptly when
// ctx is cancelled (after the command's process group is stopped, within
// KillGrace plus a moment). It is a daemon.Handler.
func (e *Executor) Handle(ctx context.Context, cmd *nodev1.Command) daemon.Outcome {
	kind := cmd.GetKind()
	if !cmdkind.IsTyped(kind) {
		return failf(CodeUnknownKind, "kind %q is not one this node executes (%s)", kind, strings.Join(cmdkind.Kinds(), ", "))
	}
	// The node checks sizes and checksums itself to report them with
	// their own codes; everything else is cmdkind's.
	msg, err := cmdkind.ParseWith(kind, cmd.GetPayload(), cmdkind.Options{MaxContentBytes: -1, SkipChecksumMatch: true})
	if err != nil {
		return failf(CodeInvalidPayload, "%v", err)
	}
	var deadline time.Time
	if cmd.GetDeadline() != nil {
		deadline = cmd.GetDeadline().AsTime()
	}
	log := e.log.With("command", cmd.GetCommandId(), "kind", kind)
	switch p := msg.(type) {
	case *nodev1.ExecPayload:
		return e.runProcess(ctx, log, runSpec{id: cmd.GetCommandId(), argv: p.GetArgv(), env: p.GetEnv(), dir: p.GetDir(), user: p.GetUser(),
			group: p.GetGroup(), stdin: p.GetStdin(), timeout: p.GetTimeout().AsDuration(), deadline: deadline})
	case *nodev1.ScriptPayload:
		return e.runScript(ctx, log, cmd.GetCommandId(), p, deadline)
	case *nodev1.FilePutPayload:
		return e.filePut(log, p)
	case *nodev1.FileGetPayload:
		return e.fileGet(ctx, p)
	case *nodev1.FactsPayload:
		return e.facts()
	case *nodev1.RebootPayload:
		return e.reboot(log, p)
	}
	return failf(CodeUnknownKind, "kind %q has no executor", kind)
}

// failf is the Outcome of a command that could not run: exit code -1 and
// an Err starting with code.
func failf(code, format string, args ...any) daemon.Outcome {
	return daemon.Outcome{ExitCode: -1, Err: code + ": " + fmt.Sprintf(format, args...)}
}

// codeError carries a code to the Outcome.
type codeError struct {
	code string
	err  error
}

func (e *codeError) Error() string { return e.code + ": " + e.err.Error() }
func (e *codeError) Unwrap() error { return e.err }

func coded(code string, format string, args ...any) error {
	return &codeError{code: code, err: fmt.Errorf(format, args...)}
}

// outcomeOf turns err into a failed Outcome, with its code, or one chosen
// from the OS error it wraps.
func outcomeOf(err error) daemon.Outcome {
	var ce *codeError
	if errors.As(err, &ce) {
		// The code goes first, before the context wrapped around it.
		return daemon.Outcome{ExitCode: -1, Err: ce.code + ": " + strings.Replace(err.Error(), ce.code+": ", "", 1)}
	}
	code := CodeIOError
	switch {
	case errors.Is(err, os.ErrNotExist):
		code = CodeNotFound
	case errors.Is(err, os.ErrPermission):
		code = CodePermissionDenied
	}
	return daemon.Outcome{ExitCode: -1, Err: code + ": " + err.Error()}
}

// jsonOutput is a result Output holding v as one JSON line.
func jsonOutput(v any) daemon.Outcome {
	b, err := json.Marshal(v)
	if err != nil {
		return failf(CodeIOError, "encode result: %v", err)
	}
	return daemon.Outcome{Output: append(b, '\n')}
}
