// Package zygote keeps a checkpoint of a container sandbox's processes in memory, as
// zygotes: at the checkpoint each process is made to fork (a system call injected with
// ptrace) a copy-on-write copy of itself, which is frozen before it runs an instruction.
// A rollback kills the live processes and makes each zygote fork again: the new process
// gets the PID, the memory, the registers and the descriptors the original had at the
// checkpoint. No page is copied on either path; the kernel copies a page when one side
// first writes it.
//
// # Eligibility
//
// A sandbox's processes are captured this way only if every one of them is a direct
// child of the sandbox's init, single-threaded, without children, not traced, stopped
// or exiting, holds no pending signal, no interval timer, no POSIX timer, no locked
// memory, no flock/OFD lock, and its descriptors are regular files, directories, FIFOs,
// pipes and memory devices (/dev/null, /dev/zero, ...) of the root filesystem, none of
// them deleted; its mappings are private or read-only. Anything else (threads, sockets,
// terminals, event fds, shared writable memory, process trees) goes through CRIU, and
// Capture says why (Ineligible).
//
// # What fork does not copy, and how it is made right
//
// A zygote shares its open file descriptions with the process it copies, which keeps
// running: offsets, status flags and the unread content of pipes move on. Capture
// records them (Record), and Spawn puts them back in the new process: lseek and fcntl
// for offsets and flags, the recorded bytes for pipes and FIFOs (drained and refilled
// through the zygote's descriptor), a fresh open for a file that the rollback's in-place
// filesystem revert recreated (the zygote's descriptor then names a deleted inode).
// POSIX record locks, the parent-death signal and the child-subreaper flag are not
// inherited by fork: they are recorded and set again. The PID comes from the pid
// namespace's ns_last_pid (the caller's Spawn hook), the parent from CLONE_PARENT: the
// zygote is a child of init, and so is every process forked from it.
//
// # Holding zygotes
//
// Each zygote is alone in a freezer cgroup of its own (Capture's cgroup directory), so
// that one can be thawed for a rollback or a dump without letting any other run, and so
// that no signal sent inside the sandbox can wake it (a frozen task stays frozen). It
// stays in the sandbox's other cgroups: its pages are charged to the sandbox's memory
// cgroup (they are the sandbox's pages), its PID to its pids cgroup.
package zygote

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/internal/dirty"
	"github.com/cairn-sandbox/cairn/internal/ptrace"
	"github.com/cairn-sandbox/cairn/isolation"
)

// RecordFile is the name of a checkpoint's zygote record in its images directory.
const RecordFile = "zygote.json"

// Version of the record format.
const Version = 1

// Record is what a checkpoint keeps about its zygotes: written by Capture, read by
// Spawn. It lives in the checkpoint's images directory (RecordFile), published with it.
type Record struct {
	Version int `json:"version"`
	// Init is the sandbox's init the zygotes belong to: they can only serve a rollback
	// of that same init's sandbox (same pid namespace, same root).
	Init  isolation.Proc `json:"init"`
	Procs []Proc         `json:"procs"`

	// proc is the /proc of the sandbox's pid namespace once looked for (nsProc).
	proc *string
}

// Proc is one process of the sandbox at the checkpoint and its zygote.
type Proc struct {
	// NSPid is the process's PID in the sandbox's pid namespace, which the process
	// spawned from the zygote gets again.
	NSPid int `json:"ns_pid"`
	// Zygote is the host process of the zygote; ZygoteNSPid its PID inside.
	Zygote      isolation.Proc `json:"zygote"`
	ZygoteNSPid int            `json:"zygote_ns_pid"`
	// Cgroup is the zygote's freezer cgroup directory (host path).
	Cgroup string `json:"cgroup"`
	Cwd    Inode  `json:"cwd"`
	Exe    string `json:"exe"`
	Fds    []Fd   `json:"fds"`
	Locks  []Lock `json:"locks,omitempty"`
	// Maps are the file-backed mappings (their start address and path).
	Maps           []Map `json:"maps,omitempty"`
	PdeathSig      int   `json:"pdeath_sig,omitempty"`
	ChildSubreaper bool  `json:"child_subreaper,omitempty"`
	// Dumpable is the process's prctl(PR_GET_DUMPABLE) (0 or 1), which Spawn gives back
	// to its copies: a zygote is made non-dumpable, so that the sandbox's processes
	// (no CAP_SYS_PTRACE) can read neither its memory nor its /proc entries — it holds
	// the sandbox's state at the checkpoint, which a rollback elsewhere must not reveal.
	// Records written before lack it (their zygotes are dumpable).
	Dumpable *int `json:"dumpable,omitempty"`
	// Regs are the process's registers at the checkpoint, its zygote's own: a zygote
	// that a crash left parked (Spawn) gets them back from here (Settle, Spawn). Records
	// written before they were kept lack them.
	Regs *unix.PtraceRegs `json:"regs,omitempty"`
	// Xstate is the process's extended processor state (floating-point and vector
	// registers, ptrace.Tracee.Xstate) and Brk its program break at the checkpoint: a
	// fork copies both, a rewind in place sets them again. Records written before lack
	// them (their checkpoints are not rewound).
	Xstate []byte `json:"xstate,omitempty"`
	Brk    uint64 `json:"brk,omitempty"`
	// VDSO is where the process's vDSO starts (its zygote's too), so that calls
	// injected into the zygote need not read its maps to find a syscall instruction.
	// Records written before lack it.
	VDSO uint64 `json:"vdso,omitempty"`

	// spawned is the process Spawn forked from the zygote, until park detaches it.
	spawned *ptrace.Tracee
	// maps are the process's mappings when it was scanned (it stays stopped: they
	// hold until its zygote is forked), zygoteMaps its zygote's once forked (a rewind
	// compares the process with them: Tracks.preload); neither is recorded.
	maps, zygoteMaps []dirty.Mapping
}

// Inode names a file of the sandbox's root by path, with the identity it had.
type Inode struct {
	Path string `json:"path"`
	Dev  uint64 `json:"dev"`
	Ino  uint64 `json:"ino"`
}

// Kinds of descriptors.
const (
	KindFile = "file" // regular file
	KindDir  = "dir"
	KindFIFO = "fifo"
	KindPipe = "pipe"
	KindChar = "char" // a memory device: /dev/null, /dev/zero, /dev/full, /dev/random, /dev/urandom
)

// Fd is one descriptor of a process at the checkpoint.
type Fd struct {
	Fd   int    `json:"fd"`
	Kind string `json:"kind"`
	// Inode is the file (Path empty for an anonymous pipe, whose Ino is the pipe's).
	Inode
	// Flags are the file status flags (fdinfo "flags", O_CLOEXEC included: it is the
	// descriptor's own flag, kept in fdinfo alongside).
	Flags int   `json:"flags"`
	Pos   int64 `json:"pos"`
	// Data is the unread content of a pipe or FIFO.
	Data []byte `json:"data,omitempty"`
	// locks are fdinfo's lock lines, read by locksOf.
	locks []string
}

// Lock is a POSIX record lock the process held.
type Lock struct {
	Fd    int   `json:"fd"` // a descriptor of the process on the locked file
	Write bool  `json:"write"`
	Start int64 `json:"start"`
	Len   int64 `json:"len"` // 0: to the end of the file
}

// Map is a file-backed mapping.
type Map struct {
	Start uint64 `json:"start"`
	Path  string `json:"path"`
}

// Ineligible says why a sandbox's processes cannot be captured as zygotes.
type Ineligible struct {
	Reason string
	// ending: a process has exited or is exiting (init has not reaped it yet, or it
	// exited while the capture stopped it); a capture a moment later may not see it.
	ending bool
}

func (e *Ineligible) Error() string { return "not eligible for zygotes: " + e.Reason }

func ineligible(format string, args ...any) error {
	return &Ineligible{Reason: fmt.Sprintf(format, args...)}
}

// Write stores r in dir (temporary name, rename). It is not synced: the record is only
// of use while its zygotes live, and a crash of the machine ends them; a crash of cairn
// leaves the page cache, and the record, intact.
func (r *Record) Write(dir string) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	tmp := filepath.Join(dir, RecordFile+".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		os.Remove(tmp)
		return err
	}
	return os.Rename(tmp, filepath.Join(dir, RecordFile))
}

// Read loads the record of dir; ok is false if there is none.
func Read(dir string) (r *Record, ok bool, err error) {
	b, err := os.ReadFile(filepath.Join(dir, RecordFile))
	if os.IsNotExist(err) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	if r, err = Decode(b); err != nil {
		return nil, false, fmt.Errorf("zygote record %s: %w", dir, err)
	}
	return r, true, nil
}

// Decode parses a record as Write wrote it.
func Decode(b []byte) (*Record, error) {
	r := &Record{}
	if err := json.Unmarshal(b, r); err != nil {
		return nil, err
	}
	if r.Version != Version {
		return nil, fmt.Errorf("version %d, this cairn reads %d", r.Version, Version)
	}
	return r, nil
}

// Alive reports whether every zygote of r still exists.
func (r *Record) Alive() bool {
	for _, p := range r.Procs {
		if !p.Zygote.Alive() {
			return false
		}
	}
	return true
}
