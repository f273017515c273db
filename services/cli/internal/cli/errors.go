package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"connectrpc.com/connect"
)

// Exit statuses.
const (
	exitOK          = 0
	exitFailed      = 1
	exitUsage       = 2
	exitInterrupted = 130
)

// usageError is bad usage: an unknown flag, a bad argument, no context.
// It exits 2.
type usageError struct {
	err  error
	hint string
}

func (e *usageError) Error() string { return e.err.Error() }
func (e *usageError) Unwrap() error { return e.err }

// usagef returns a usage error.
func usagef(format string, args ...any) error {
	return &usageError{err: fmt.Errorf(format, args...)}
}

// exitError ends the process with code after its message (if any) was
// printed by the command itself.
type exitError struct {
	code int
	msg  string
}

func (e *exitError) Error() string { return e.msg }

// hinted is an operation error with a hint line for the operator.
type hinted struct {
	err  error
	hint string
}

func (e *hinted) Error() string { return e.err.Error() }
func (e *hinted) Unwrap() error { return e.err }

// withHint attaches hint to err.
func withHint(err error, hint string) error {
	if err == nil || hint == "" {
		return err
	}
	return &hinted{err: err, hint: hint}
}

// report prints err on w as one line (plus a hint line) and returns the
// exit status: 0 without error, 2 for usage, 130 when interrupted, 1 for a
// failed operation.
func report(w io.Writer, err error, interrupted bool) int {
	if err == nil {
		return exitOK
	}
	var ee *exitError
	if errors.As(err, &ee) {
		if ee.msg != "" {
			_, _ = fmt.Fprintf(w, "leasehold: %s\n", ee.msg)
		}
		return ee.code
	}
	if interrupted && (errors.Is(err, context.Canceled) || connect.CodeOf(err) == connect.CodeCanceled) {
		return exitInterrupted
	}
	var ue *usageError
	if errors.As(err, &ue) {
		_, _ = fmt.Fprintf(w, "leasehold: %s\n", oneLine(ue.Error()))
		if ue.hint != "" {
			_, _ = fmt.Fprintf(w, "hint: %s\n", ue.hint)
		}
		return exitUsage
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		_, _ = fmt.Fprintf(w, "leasehold: %s: %s\n", ce.Code(), oneLine(ce.Message()))
	} else {
		_, _ = fmt.Fprintf(w, "leasehold: %s\n", oneLine(err.Error()))
	}
	var h *hinted
	if errors.As(err, &h) {
		_, _ = fmt.Fprintf(w, "hint: %s\n", h.hint)
	}
	return exitFailed
}

// oneLine folds a message onto one line.
func oneLine(s string) string {
	return strings.Join(strings.Fields(s), " ")
}

// classifyCobra turns cobra's own argument and flag errors into usage errors.
func classifyCobra(err error) error {
	if err == nil {
		return nil
	}
	var ue *usageError
	if errors.As(err, &ue) {
		return err
	}
	msg := err.Error()
	for _, p := range []string{"unknown command", "unknown flag", "unknown shorthand flag", "required flag", "invalid argument",
		"flag needs an argument", "accepts ", "requires at least", "requires at most", "bad flag syntax", "if any flags in the group"} {
		if strings.HasPrefix(msg, p) || strings.Contains(msg, p) && strings.HasPrefix(p, "if any") {
			return &usageError{err: err}
		}
	}
	return err
}
