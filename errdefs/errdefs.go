// Package errdefs is cairn's one vocabulary of error classes, shared from the engine to
// the API and the SDKs (after containerd's errdefs).
//
// Errors are classified by wrapping one of the sentinel values below with %w where they
// arise; callers test with errors.Is or the Is* helpers. Messages say what failed and
// what to do about it.
package errdefs

import (
	"context"
	"errors"
	"fmt"
)

// The classes. Each maps to one HTTP status and one SDK exception.
var (
	ErrNotFound           = errors.New("not found")
	ErrAlreadyExists      = errors.New("already exists")
	ErrInvalidArgument    = errors.New("invalid argument")
	ErrFailedPrecondition = errors.New("failed precondition")
	ErrConflict           = errors.New("conflict")
	ErrUnavailable        = errors.New("unavailable")
	ErrResourceExhausted  = errors.New("resource exhausted")
	ErrPermissionDenied   = errors.New("permission denied")
	ErrInternal           = errors.New("internal")
)

// classes in the order Class tests them.
var classes = []error{
	ErrNotFound, ErrAlreadyExists, ErrInvalidArgument, ErrFailedPrecondition,
	ErrConflict, ErrUnavailable, ErrResourceExhausted, ErrPermissionDenied, ErrInternal,
}

// Code returns the stable machine-readable code of err's class ("not_found", ...), or
// "internal" for unclassified errors and "canceled"/"deadline_exceeded" for context errors.
func Code(err error) string {
	switch {
	case err == nil:
		return ""
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.Is(err, context.DeadlineExceeded):
		return "deadline_exceeded"
	}
	for _, c := range classes {
		if errors.Is(err, c) {
			return codeOf(c)
		}
	}
	return "internal"
}

func codeOf(c error) string {
	switch c {
	case ErrNotFound:
		return "not_found"
	case ErrAlreadyExists:
		return "already_exists"
	case ErrInvalidArgument:
		return "invalid_argument"
	case ErrFailedPrecondition:
		return "failed_precondition"
	case ErrConflict:
		return "conflict"
	case ErrUnavailable:
		return "unavailable"
	case ErrResourceExhausted:
		return "resource_exhausted"
	case ErrPermissionDenied:
		return "permission_denied"
	}
	return "internal"
}

// FromCode returns the class sentinel for a code produced by Code (ErrInternal if unknown).
func FromCode(code string) error {
	for _, c := range classes {
		if codeOf(c) == code {
			return c
		}
	}
	switch code {
	case "canceled":
		return context.Canceled
	case "deadline_exceeded":
		return context.DeadlineExceeded
	}
	return ErrInternal
}

// ExitCode is the CLI exit status for err's class, stable for scripts:
// 0 ok, 1 internal, 2 invalid argument, 3 not found, 4 already exists / conflict,
// 5 failed precondition, 6 unavailable, 7 resource exhausted, 8 permission denied.
func ExitCode(err error) int {
	switch Code(err) {
	case "":
		return 0
	case "invalid_argument":
		return 2
	case "not_found":
		return 3
	case "already_exists", "conflict":
		return 4
	case "failed_precondition":
		return 5
	case "unavailable", "canceled", "deadline_exceeded":
		return 6
	case "resource_exhausted":
		return 7
	case "permission_denied":
		return 8
	}
	return 1
}

// Helpers to build classified errors: errdefs.NotFound("sandbox %q", id).
func NotFound(format string, a ...any) error      { return wrap(ErrNotFound, format, a) }
func AlreadyExists(format string, a ...any) error { return wrap(ErrAlreadyExists, format, a) }
func InvalidArgument(format string, a ...any) error {
	return wrap(ErrInvalidArgument, format, a)
}
func FailedPrecondition(format string, a ...any) error {
	return wrap(ErrFailedPrecondition, format, a)
}
func Conflict(format string, a ...any) error    { return wrap(ErrConflict, format, a) }
func Unavailable(format string, a ...any) error { return wrap(ErrUnavailable, format, a) }
func ResourceExhausted(format string, a ...any) error {
	return wrap(ErrResourceExhausted, format, a)
}
func PermissionDenied(format string, a ...any) error {
	return wrap(ErrPermissionDenied, format, a)
}

type classified struct {
	class error
	msg   string
	cause error
}

func (e *classified) Error() string { return e.msg }
func (e *classified) Unwrap() []error {
	if e.cause != nil {
		return []error{e.class, e.cause}
	}
	return []error{e.class}
}

// wrap formats the message; a %w verb in format keeps the cause reachable by errors.Is.
func wrap(class error, format string, a []any) error {
	err := fmt.Errorf(format, a...)
	return &classified{class: class, msg: err.Error(), cause: errors.Unwrap(err)}
}
