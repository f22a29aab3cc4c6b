package ptrace

import (
	"errors"
	"fmt"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// stepTimeout bounds how long one injected system call may take to return: a process
// whose call has not returned by then is killed (waitRun). A clone gets cloneSteps
// times as long: it copies the process's page tables, milliseconds per hundred MB
// here, and a slow fork of a very large process must not cost the process itself.
// Variables for tests.
var (
	stepTimeout = 10 * time.Second
	cloneSteps  = 6
)

// Syscall runs one system call in the stopped tracee and returns its result; a negative
// result is returned as the errno. The tracee's own registers are put back afterwards
// (a setregs: the crash window is the call alone).
//
// Preconditions: the tracee is stopped (Wait returned).
func (t *Tracee) Syscall(nr uintptr, args ...uintptr) (uintptr, error) {
	r, _, err := t.syscall(nr, args)
	return r, err
}

func (t *Tracee) syscall(nr uintptr, args []uintptr) (uintptr, *Tracee, error) {
	if len(args) > 6 {
		return 0, nil, fmt.Errorf("syscall %d: %d arguments, at most 6", nr, len(args))
	}
	if err := t.locate(); err != nil {
		return 0, nil, err
	}
	if nr == unix.SYS_CLONE {
		t.unpin() // see colocate.go: a fork runs best where the scheduler puts it
	} else {
		t.colocate()
	}
	r := t.saved
	r.Rip = t.syscallAt
	r.Rax = uint64(nr)
	// No system call to restart: a tracee stopped inside one (say, a blocking read)
	// would otherwise have its registers rewound by the kernel's restart logic when it
	// resumes into ours.
	r.Orig_rax = ^uint64(0)
	var a [6]uint64
	for i, v := range args {
		a[i] = uint64(v)
	}
	r.Rdi, r.Rsi, r.Rdx, r.R10, r.R8, r.R9 = a[0], a[1], a[2], a[3], a[4], a[5]
	t.setInjected(true)
	if err := unix.PtraceSetRegs(t.Pid, &r); err != nil {
		return 0, nil, fmt.Errorf("ptrace setregs %d: %w", t.Pid, err)
	}
	timeout := stepTimeout
	if nr == unix.SYS_CLONE {
		timeout *= time.Duration(cloneSteps)
	}
	child, err := t.step(timeout)
	if child != nil {
		child.setInjected(true) // born with the call's registers
	}
	if err != nil {
		return 0, child, err
	}
	t.sysStop = true
	var out unix.PtraceRegs
	if err := unix.PtraceGetRegs(t.Pid, &out); err != nil {
		return 0, child, fmt.Errorf("ptrace getregs %d: %w", t.Pid, err)
	}
	if err := t.Restore(); err != nil {
		return 0, child, err
	}
	if res := int64(out.Rax); res < 0 && res > -4096 {
		return 0, child, syscall.Errno(-res)
	}
	return uintptr(out.Rax), child, nil
}

// step runs the tracee from its instruction pointer (a syscall instruction) to the end
// of that call, through its system-call stops (PTRACE_SYSCALL, not PTRACE_SINGLESTEP:
// the kernel clears system-call tracing when it detaches a tracee whose tracer died,
// but not the trap flag of single-stepping, which would kill the tracee with SIGTRAP
// after its next instruction). A fork or clone reports its child in between: that child
// is returned, seized (it starts stopped). A call that has not returned within timeout
// kills the tracee (waitRun).
func (t *Tracee) step(timeout time.Duration) (*Tracee, error) {
	var child *Tracee
	entered := false
	for {
		if err := unix.PtraceSyscall(t.Pid, 0); err != nil {
			return child, fmt.Errorf("ptrace syscall %d: %w", t.Pid, err)
		}
		ws, err := t.waitRun(timeout)
		if err != nil {
			return child, err
		}
		switch ev := event(ws); {
		case ws.StopSignal() == unix.SIGTRAP|0x80:
			if entered {
				return child, nil // the call's exit
			}
			entered = true
		case ev == unix.PTRACE_EVENT_CLONE || ev == unix.PTRACE_EVENT_FORK || ev == unix.PTRACE_EVENT_VFORK:
			msg, err := unix.PtraceGetEventMsg(t.Pid)
			if err != nil {
				return child, fmt.Errorf("ptrace geteventmsg %d: %w", t.Pid, err)
			}
			child = &Tracee{Pid: int(msg)}
		case ev == 0 && ws.StopSignal() != unix.SIGTRAP:
			// A signal arrived before the call ran: keep it for Detach, go on.
			t.pending = append(t.pending, ws.StopSignal())
		}
	}
}

// Fork makes the tracee call clone(flags) and returns the new process, attached and
// stopped, its registers saved: those of the call's return in the child (Rax 0), which
// the caller normally replaces with SetRegs. The child's PID is the host's.
//
// Preconditions: the tracee is stopped (Wait returned).
func (t *Tracee) Fork(flags uintptr) (*Tracee, error) {
	// Flags, stack (0: the child runs on the caller's stack, copy-on-write), parent TID,
	// child TID, TLS.
	pid, child, err := t.syscall(unix.SYS_CLONE, []uintptr{flags, 0, 0, 0, 0})
	if err != nil {
		if child != nil {
			unix.Kill(child.Pid, unix.SIGKILL)
			child.setInjected(false)
		}
		return nil, fmt.Errorf("clone in %d: %w", t.Pid, err)
	}
	if child == nil {
		return nil, fmt.Errorf("clone in %d: no child reported", t.Pid)
	}
	if err := child.waitStop(stepTimeout, child.waitRun); err != nil {
		unix.Kill(child.Pid, unix.SIGKILL)
		child.setInjected(false)
		return nil, fmt.Errorf("new child %d of %d: %w", child.Pid, t.Pid, err)
	}
	child.syscallAt = t.syscallAt // same address space layout
	child.ClonedAs = int(pid)
	// Born with the parent's affinity, pinned or not: given the parent's own at Detach.
	child.pinned, child.mask = t.pinned, t.mask
	return child, nil
}

// ReadMem reads the tracee's memory at addr.
func (t *Tracee) ReadMem(addr uint64, b []byte) error {
	local := []unix.Iovec{{Base: &b[0], Len: uint64(len(b))}}
	remote := []unix.RemoteIovec{{Base: uintptr(addr), Len: len(b)}}
	n, err := unix.ProcessVMReadv(t.Pid, local, remote, 0)
	if err != nil {
		return fmt.Errorf("read memory of %d at %#x: %w", t.Pid, addr, err)
	}
	if n != len(b) {
		return fmt.Errorf("read memory of %d at %#x: short read (%d of %d)", t.Pid, addr, n, len(b))
	}
	return nil
}

// WriteMem writes b into the tracee's memory at addr.
func (t *Tracee) WriteMem(addr uint64, b []byte) error {
	local := []unix.Iovec{{Base: &b[0], Len: uint64(len(b))}}
	remote := []unix.RemoteIovec{{Base: uintptr(addr), Len: len(b)}}
	n, err := unix.ProcessVMWritev(t.Pid, local, remote, 0)
	if err != nil {
		return fmt.Errorf("write memory of %d at %#x: %w", t.Pid, addr, err)
	}
	if n != len(b) {
		return fmt.Errorf("write memory of %d at %#x: short write (%d of %d)", t.Pid, addr, n, len(b))
	}
	return nil
}

// Scratch is a private anonymous page mapped into a tracee for the arguments of
// injected calls (paths, structures), or bytes of its stack lent for them
// (BorrowStack). Free unmaps it, or gives the bytes back.
type Scratch struct {
	t    *Tracee
	Addr uint64
	Size int
	// lent holds what the borrowed bytes held (BorrowStack); nil for a mapped page.
	lent []byte
}

// BorrowStack lends size bytes of the tracee's own stack, from its stack pointer up, as
// scratch memory: what they hold is saved, and Free writes it back. The tracee is
// stopped and does not read them meanwhile, and an injected call does not touch the
// stack, so it never sees the change. It costs a few accesses to the tracee's memory
// instead of an injected mmap and munmap. It fails where the stack pointer has not
// size readable and writable bytes above it (they are written back as they are, to
// know); Scratch then maps a page instead.
func (t *Tracee) BorrowStack(size int) (*Scratch, error) {
	regs := t.Regs()
	lent := make([]byte, size)
	if err := t.ReadMem(regs.Rsp, lent); err != nil {
		return nil, err
	}
	if err := t.WriteMem(regs.Rsp, lent); err != nil {
		return nil, err
	}
	return &Scratch{t: t, Addr: regs.Rsp, Size: size, lent: lent}, nil
}

// Scratch returns size bytes of scratch memory in the tracee: bytes of its stack where
// it can lend them (BorrowStack), else a page mapped for them (MapScratch). Free gives
// them back.
func (t *Tracee) Scratch(size int) (*Scratch, error) {
	if s, err := t.BorrowStack(size); err == nil {
		return s, nil
	}
	return t.MapScratch(size)
}

// MapScratch maps size bytes of scratch memory into the tracee.
func (t *Tracee) MapScratch(size int) (*Scratch, error) {
	size = (size + 4095) &^ 4095
	addr, err := t.Syscall(unix.SYS_MMAP, 0, uintptr(size), unix.PROT_READ|unix.PROT_WRITE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS, ^uintptr(0), 0)
	if err != nil {
		return nil, fmt.Errorf("scratch memory in %d: %w", t.Pid, err)
	}
	return &Scratch{t: t, Addr: uint64(addr), Size: size}, nil
}

// Put writes b at offset off of the scratch memory and returns its address.
func (s *Scratch) Put(off int, b []byte) (uintptr, error) {
	if off < 0 || off+len(b) > s.Size {
		return 0, errors.New("scratch memory overflow")
	}
	if len(b) > 0 {
		if err := s.t.WriteMem(s.Addr+uint64(off), b); err != nil {
			return 0, err
		}
	}
	return uintptr(s.Addr) + uintptr(off), nil
}

// Get reads len(b) bytes at offset off of the scratch memory.
func (s *Scratch) Get(off int, b []byte) error {
	if off < 0 || off+len(b) > s.Size {
		return errors.New("scratch memory overflow")
	}
	return s.t.ReadMem(s.Addr+uint64(off), b)
}

// CString is b as a NUL-terminated string.
func CString(s string) []byte { return append([]byte(s), 0) }

// Free unmaps the scratch memory, or writes back what the borrowed bytes held.
func (s *Scratch) Free() error {
	if s.lent != nil {
		return s.t.WriteMem(s.Addr, s.lent)
	}
	_, err := s.t.Syscall(unix.SYS_MUNMAP, uintptr(s.Addr), uintptr(s.Size))
	return err
}

// Bytes returns the bytes of a value (for structures passed to injected calls).
func Bytes[T any](v *T) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(v)), unsafe.Sizeof(*v))
}
