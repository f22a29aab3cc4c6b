package ptrace

import (
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Colocation. Every injected call is two round trips between the tracer and the tracee
// (its entry and its exit stop). When the tracee is woken on the other CPU, which is
// idle, each wake-up of that CPU costs tens of microseconds in a virtual machine (a
// halted vCPU is woken by the hypervisor); on the tracer's own CPU it is a context
// switch. So while it is traced (from Interrupt on), a tracee runs on its tracer's CPU only: measured on
// the 2-vCPU machines of the benchmarks, an injected getppid took 79 µs p50 (p90 104)
// across CPUs and 33-38 µs (p90 39) on one. The tracer's thread stays on the CPU it was
// on for the length of a Do (left free to move, it was slower: W1, three alternating
// pairs, checkpoint 18.4 against 16.5 ms p50, the injected calls 1.9-2.5 against
// 1.6-1.8 ms); the tracee's own affinity is given back by Detach (and by the detach of
// a forgotten tracee).
//
// Except for a clone: the tracee gets its own affinity back before one (and its copy is
// born with it), and runs it where the scheduler puts it. A fork of a large process is
// milliseconds of work in the kernel, which on the tracer's CPU took longer beside a
// checkpoint's snapshot: W1, three alternating pairs, the zygotes' clones 3.89 ms p50
// pinned against 2.75 unpinned (checkpoint 14.7 against 13.2). Calls injected into the
// copy afterwards pin it in turn (and if the tracee's affinity could not be given back,
// the copy's is its parent's own when it is detached).
//
// If the tracer dies between Interrupt and Detach, the tracee keeps the
// one-CPU affinity: it runs on, correct but on one CPU until it sets its affinity again.

// colocation turns colocate on; CAIRN_PTRACE_COLOCATE=0 turns it off (to measure
// without it, or on a machine where it does not pay).
var colocation = os.Getenv("CAIRN_PTRACE_COLOCATE") != "0"

// pinThread keeps the calling thread on the CPU it runs on. It reports whether it did.
func pinThread() bool {
	cpu, err := currentCPU()
	if err != nil {
		return false
	}
	var set unix.CPUSet
	set.Set(cpu)
	return unix.SchedSetaffinity(0, &set) == nil
}

// unpinThread lets the calling thread run on every CPU again.
func unpinThread() {
	var set unix.CPUSet
	for i := 0; i < len(set)*64; i++ {
		set.Set(i)
	}
	unix.SchedSetaffinity(0, &set) // the kernel keeps the CPUs that exist
}

// currentCPU is the CPU the calling thread runs on.
func currentCPU() (int, error) {
	var cpu, node uint32
	if _, _, errno := unix.RawSyscall(unix.SYS_GETCPU, uintptr(unsafe.Pointer(&cpu)), uintptr(unsafe.Pointer(&node)), 0); errno != 0 {
		return 0, errno
	}
	return int(cpu), nil
}

// colocate makes the tracee run on the tracer's CPU, its own affinity kept for unpin.
// It is best effort: a tracee that may not run there (its cpuset) runs where it may.
func (t *Tracee) colocate() {
	if t.pinned || !colocation {
		return
	}
	cpu, err := currentCPU()
	if err != nil {
		return
	}
	if err := unix.SchedGetaffinity(t.Pid, &t.mask); err != nil {
		return
	}
	var set unix.CPUSet
	set.Set(cpu)
	t.pinned = unix.SchedSetaffinity(t.Pid, &set) == nil
}

// Affinity is the tracee's own CPU affinity: the one colocate keeps for unpin while it
// runs on its tracer's CPU, else the kernel's.
func (t *Tracee) Affinity() (unix.CPUSet, error) {
	if t.pinned {
		return t.mask, nil
	}
	var set unix.CPUSet
	err := unix.SchedGetaffinity(t.Pid, &set)
	return set, err
}

// unpin gives the tracee its own CPU affinity back.
func (t *Tracee) unpin() {
	if !t.pinned {
		return
	}
	if unix.SchedSetaffinity(t.Pid, &t.mask) == nil || ProcState(t.Pid) == "gone" {
		t.pinned = false
	}
}
