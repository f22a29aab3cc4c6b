package ptrace

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ntX86Xstate is the register set of the extended processor state (the XSAVE area: x87,
// SSE, AVX... registers), NT_X86_XSTATE of include/uapi/linux/elf.h.
const ntX86Xstate = 0x202

// maxXstate bounds the XSAVE area read (its size is the CPU's: 2.7 KiB with AVX-512,
// more with AMX tiles).
const maxXstate = 16 << 10

// Xstate reads the tracee's extended processor state (floating-point and vector
// registers). A fork copies it; a process brought back in place must be given it again.
//
// Preconditions: the tracee is stopped (Wait returned).
func (t *Tracee) Xstate() ([]byte, error) {
	buf := make([]byte, maxXstate)
	iov := unix.Iovec{Base: &buf[0], Len: uint64(len(buf))}
	if _, _, errno := unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_GETREGSET, uintptr(t.Pid), ntX86Xstate, uintptr(unsafe.Pointer(&iov)), 0, 0); errno != 0 {
		return nil, fmt.Errorf("ptrace getregset xstate %d: %w", t.Pid, errno)
	}
	return buf[:iov.Len], nil
}

// SetXstate writes an extended processor state read by Xstate (of this tracee or of a
// copy of it) into the tracee.
//
// Preconditions: the tracee is stopped (Wait returned).
func (t *Tracee) SetXstate(b []byte) error {
	if len(b) == 0 {
		return fmt.Errorf("ptrace setregset xstate %d: no state", t.Pid)
	}
	iov := unix.Iovec{Base: &b[0], Len: uint64(len(b))}
	if _, _, errno := unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_SETREGSET, uintptr(t.Pid), ntX86Xstate, uintptr(unsafe.Pointer(&iov)), 0, 0); errno != 0 {
		return fmt.Errorf("ptrace setregset xstate %d: %w", t.Pid, errno)
	}
	return nil
}

// DropSignals forgets the signals that arrived while the tracee was stopped for us, which
// Detach would deliver again: a process brought back in place to an earlier state was
// sent them after that state, and must not receive them (a copy forked from the state
// would not).
func (t *Tracee) DropSignals() { t.pending = nil }
