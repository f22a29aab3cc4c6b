package ptrace

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// SuspendSeccomp turns the suspension of the tracee's seccomp filters on or off
// (PTRACE_O_SUSPEND_SECCOMP): while it is on, the tracee's system calls, injected ones
// included, pass none of its filters. A sandbox's filter refuses calls that cairn itself
// must make in the process (userfaultfd, say); turn it on for exactly those calls and off
// again at once (defer), on every path: the tracee's own code runs unfiltered while it is
// on.
//
// The kernel ends the suspension when the tracee is detached, by Detach or by the death
// of its tracer, so it never outlives the tracing. It needs CAP_SYS_ADMIN, a tracer that
// is not itself under seccomp, and a kernel built with CONFIG_CHECKPOINT_RESTORE (as CRIU
// needs).
//
// Preconditions: the tracee is stopped (Wait returned).
func (t *Tracee) SuspendSeccomp(on bool) error {
	// PTRACE_SETOPTIONS replaces every option: keep those the tracee was seized with.
	opts := seizeOptions
	if on {
		opts |= unix.PTRACE_O_SUSPEND_SECCOMP
	}
	if err := unix.PtraceSetOptions(t.Pid, opts); err != nil {
		return fmt.Errorf("ptrace setoptions %d (seccomp suspended: %v): %w", t.Pid, on, err)
	}
	return nil
}
