// Package seccomp builds the seccomp filter every sandbox process runs under.
//
// The filter is a deny list over a Docker-like default: it keeps the system calls an
// ordinary Linux userland uses (including ptrace, so debuggers work inside a sandbox) and
// refuses, with EPERM, those that reach past the sandbox: kernel modules, kexec, mounts,
// namespaces, BPF, perf, keyrings, clock and swap changes, raw I/O ports and handle-based
// opens. Calls from another architecture's ABI (x32, i386) are killed.
//
// io_uring is refused too, as Docker's default profile does since 2023: it has been a
// leading source of kernel vulnerabilities, CRIU cannot checkpoint a process using it
// (so no checkpoint of its sandbox could succeed), and its workers write files on a
// process's behalf while the process is stopped, which a rollback that stops the
// sandbox's processes to look at its root must not miss. Programs fall back to their
// other I/O paths when io_uring_setup fails.
package seccomp

import (
	"unsafe"

	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// Denied lists the x86_64 system calls refused with EPERM.
var Denied = []uint32{
	unix.SYS_ACCT, unix.SYS_ADD_KEY, unix.SYS_BPF, unix.SYS_CLOCK_ADJTIME, unix.SYS_CLOCK_SETTIME,
	unix.SYS_CREATE_MODULE, unix.SYS_DELETE_MODULE, unix.SYS_FINIT_MODULE, unix.SYS_FSCONFIG,
	unix.SYS_FSMOUNT, unix.SYS_FSOPEN, unix.SYS_FSPICK, unix.SYS_GET_KERNEL_SYMS, unix.SYS_GET_MEMPOLICY,
	unix.SYS_INIT_MODULE, unix.SYS_IO_URING_ENTER, unix.SYS_IO_URING_REGISTER, unix.SYS_IO_URING_SETUP, unix.SYS_IOPERM, unix.SYS_IOPL, unix.SYS_KCMP, unix.SYS_KEXEC_FILE_LOAD,
	unix.SYS_KEXEC_LOAD, unix.SYS_KEYCTL, unix.SYS_LOOKUP_DCOOKIE, unix.SYS_MBIND, unix.SYS_MOUNT,
	unix.SYS_MOUNT_SETATTR, unix.SYS_MOVE_MOUNT, unix.SYS_MOVE_PAGES, unix.SYS_NAME_TO_HANDLE_AT,
	unix.SYS_NFSSERVCTL, unix.SYS_OPEN_BY_HANDLE_AT, unix.SYS_OPEN_TREE, unix.SYS_PERF_EVENT_OPEN,
	unix.SYS_PIVOT_ROOT, unix.SYS_QUERY_MODULE, unix.SYS_QUOTACTL, unix.SYS_REBOOT, unix.SYS_REQUEST_KEY,
	unix.SYS_SET_MEMPOLICY, unix.SYS_SETNS, unix.SYS_SETTIMEOFDAY, unix.SYS_SWAPOFF, unix.SYS_SWAPON,
	unix.SYS_SYSFS, unix.SYS__SYSCTL, unix.SYS_UMOUNT2, unix.SYS_UNSHARE, unix.SYS_USELIB,
	unix.SYS_USERFAULTFD, unix.SYS_USTAT, unix.SYS_VHANGUP, unix.SYS_ADJTIMEX,
}

const (
	auditArchX86_64 = 0xc000003e
	x32SyscallBit   = 0x40000000
	retKillProcess  = 0x80000000
	retErrno        = 0x00050000
	retAllow        = 0x7fff0000
	// offsets in struct seccomp_data
	offNr   = 0
	offArch = 4
)

// Program assembles the filter.
func Program() ([]bpf.RawInstruction, error) {
	n := len(Denied)
	prog := []bpf.Instruction{
		bpf.LoadAbsolute{Off: offArch, Size: 4},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: auditArchX86_64, SkipTrue: 1},
		bpf.RetConstant{Val: retKillProcess},
		bpf.LoadAbsolute{Off: offNr, Size: 4},
		bpf.JumpIf{Cond: bpf.JumpGreaterOrEqual, Val: x32SyscallBit, SkipFalse: 1},
		bpf.RetConstant{Val: retKillProcess},
	}
	// One compare per denied call; a match jumps to the EPERM return at the end.
	for i, nr := range Denied {
		prog = append(prog, bpf.JumpIf{Cond: bpf.JumpEqual, Val: nr, SkipTrue: uint8(n - i)})
	}
	prog = append(prog,
		bpf.RetConstant{Val: retAllow},
		bpf.RetConstant{Val: retErrno | uint32(unix.EPERM)},
	)
	return bpf.Assemble(prog)
}

// Install loads the filter into the calling thread. The caller must hold CAP_SYS_ADMIN
// or have set no_new_privs; the filter is inherited across fork and execve.
//
// Preconditions: the goroutine is locked to its OS thread, and that thread is the one
// that will execve the sandbox's init.
func Install() error {
	raw, err := Program()
	if err != nil {
		return err
	}
	fprog := unix.SockFprog{Len: uint16(len(raw)), Filter: (*unix.SockFilter)(unsafe.Pointer(&raw[0]))}
	_, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, 0, uintptr(unsafe.Pointer(&fprog)))
	if errno != 0 {
		return errno
	}
	return nil
}
