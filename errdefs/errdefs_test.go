package errdefs

import (
	"context"
	"errors"
	"fmt"
	"testing"
)

func TestClasses(t *testing.T) {
	cause := errors.New("disk on fire")
	tests := []struct {
		err  error
		code string
		exit int
	}{
		{NotFound("sandbox %q", "x"), "not_found", 3},
		{AlreadyExists("template %q", "t"), "already_exists", 4},
		{InvalidArgument("count %d", 0), "invalid_argument", 2},
		{FailedPrecondition("stopped"), "failed_precondition", 5},
		{Conflict("busy"), "conflict", 4},
		{Unavailable("later"), "unavailable", 6},
		{ResourceExhausted("full: %w", cause), "resource_exhausted", 7},
		{PermissionDenied("root"), "permission_denied", 8},
		{fmt.Errorf("wrapped: %w", NotFound("deep")), "not_found", 3},
		{errors.New("plain"), "internal", 1},
		{context.Canceled, "canceled", 6},
		{nil, "", 0},
	}
	for _, tc := range tests {
		if got := Code(tc.err); got != tc.code {
			t.Errorf("Code(%v) = %q, want %q", tc.err, got, tc.code)
		}
		if got := ExitCode(tc.err); got != tc.exit {
			t.Errorf("ExitCode(%v) = %d, want %d", tc.err, got, tc.exit)
		}
		if tc.err != nil && tc.code != "internal" && !errors.Is(FromCode(tc.code), FromCode(Code(tc.err))) {
			t.Errorf("FromCode(%q) does not round-trip", tc.code)
		}
	}
	if err := ResourceExhausted("full: %w", cause); !errors.Is(err, cause) || err.Error() != "full: disk on fire" {
		t.Errorf("cause lost: %v", err)
	}
}
