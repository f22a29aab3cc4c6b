// Package ptrace runs system calls inside other processes (x86-64 Linux): it stops a
// process with PTRACE_SEIZE + PTRACE_INTERRUPT, points its instruction pointer at a
// `syscall` instruction of its vDSO with the call's number and arguments in its
// registers, steps over that one instruction, and puts every register back. It is the
// mechanism of cairn's zygotes, which make a sandbox process fork a frozen copy of
// itself at a checkpoint and make that copy fork again at a rollback.
//
// Threads. Linux delivers a tracee's stops to the thread that attached, and accepts
// requests about it only from that thread: every call of a Tracee must come from the
// OS thread that seized it. A Tracer owns such a thread; run all work through Tracer.Do.
//
// Crash windows. While a system call is being injected the tracee's registers are not
// its own. If the tracer dies in that window the kernel detaches the tracee, which then
// runs on from the injected state and most likely crashes. Each window lasts one system
// call (tens of microseconds); between calls the registers are the tracee's. Callers
// that must survive their own crash keep those windows short and put their crash points
// between them.
package ptrace

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Tracer is an OS thread that traces processes. The zero value is not usable; use
// NewTracer, and Close it when done (tracees still attached are detached then).
type Tracer struct {
	work chan func()
	done chan struct{}
	once sync.Once
	// stale are tracees given up on before they stopped (Forget); only the tracer's
	// thread touches it.
	stale []*Tracee
}

// NewTracer starts a tracer thread.
func NewTracer() *Tracer {
	t := &Tracer{work: make(chan func()), done: make(chan struct{})}
	go func() {
		// The thread is never handed back to the Go scheduler: it ends with this goroutine
		// still locked, and the runtime ends the thread with it (so nothing else ever runs
		// on a thread that is some process's tracer).
		runtime.LockOSThread()
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case f, ok := <-t.work:
				if !ok {
					close(t.done)
					return
				}
				t.detachStale()
				f()
			case <-tick.C:
				t.detachStale()
			}
		}
	}()
	return t
}

// Forget hands over a tracee that could not be waited for (it did not stop in time,
// say in an uninterruptible sleep): the tracer detaches it once it stops, so that it
// does not sit in a ptrace stop forever. Call it inside Do.
func (t *Tracer) Forget(tc *Tracee) { t.stale = append(t.stale, tc) }

func (t *Tracer) detachStale() {
	keep := t.stale[:0]
	for _, tc := range t.stale {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(tc.Pid, &ws, unix.WALL|unix.WNOHANG, nil)
		switch {
		case err != nil || ws.Exited() || ws.Signaled():
			// gone, or no longer ours
		case pid == tc.Pid && ws.Stopped():
			tc.pending = nil // its registers were never changed
			unix.PtraceDetach(tc.Pid)
		default:
			keep = append(keep, tc)
		}
	}
	t.stale = keep
}

// Do runs f on the tracer's thread and returns its error.
func (t *Tracer) Do(f func() error) error {
	errc := make(chan error, 1)
	t.work <- func() { errc <- f() }
	return <-errc
}

// Close ends the tracer's thread.
func (t *Tracer) Close() {
	t.once.Do(func() {
		close(t.work)
		<-t.done
	})
}

// Tracee is a process seized by a Tracer. Its methods must be called on that tracer's
// thread (inside Do).
type Tracee struct {
	Pid int
	// saved are the tracee's own registers, read when it stopped; Restore puts them back.
	saved unix.PtraceRegs
	// syscallAt is the address of a `syscall` instruction in the tracee's vDSO.
	syscallAt uint64
	// pending are signals that arrived while the tracee was stopped for us; Detach
	// delivers them again.
	pending []syscall.Signal
}

// Options every tracee is seized with: the children it forks or clones are attached too
// (they start stopped), and the tracer's exit does not kill anything (PTRACE_O_EXITKILL
// is deliberately absent: a crash of cairn must not take sandbox processes with it).
// PTRACE_O_TRACESYSGOOD marks system-call stops (SIGTRAP|0x80), which injections step
// through.
const seizeOptions = unix.PTRACE_O_TRACECLONE | unix.PTRACE_O_TRACEFORK | unix.PTRACE_O_TRACEVFORK | unix.PTRACE_O_TRACESYSGOOD

// Seize attaches to pid without stopping it. Interrupt, then Wait, stops it.
func Seize(pid int) (*Tracee, error) {
	if _, _, errno := unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_SEIZE, uintptr(pid), 0, seizeOptions, 0, 0); errno != 0 {
		return nil, fmt.Errorf("ptrace seize %d: %w", pid, errno)
	}
	return &Tracee{Pid: pid}, nil
}

// Interrupt asks a seized tracee to stop. A frozen tracee (cgroup freezer) stops once
// it is thawed.
func (t *Tracee) Interrupt() error {
	if err := unix.PtraceInterrupt(t.Pid); err != nil {
		return fmt.Errorf("ptrace interrupt %d: %w", t.Pid, err)
	}
	return nil
}

// ErrExited is returned when the tracee exited while we waited for it.
var ErrExited = errors.New("process exited")

// Wait waits until the tracee is in a ptrace stop caused by Interrupt (or the attach of
// a new child), then saves its registers. Signals that arrive first are noted and
// suppressed; Detach delivers them again.
func (t *Tracee) Wait(timeout time.Duration) error {
	for {
		ws, err := t.wait(timeout)
		if err != nil {
			return err
		}
		if event(ws) == unix.PTRACE_EVENT_STOP {
			// The interrupt (SIGTRAP), a group stop (a stop signal), or the first stop of
			// a new child: stopped, and injectable.
			return t.save()
		}
		if sig := ws.StopSignal(); sig != unix.SIGTRAP {
			t.pending = append(t.pending, sig)
		}
		// Any other stop: let it go on to the interrupt (without the signal).
		if err := unix.PtraceCont(t.Pid, 0); err != nil {
			return fmt.Errorf("ptrace cont %d: %w", t.Pid, err)
		}
	}
}

// event is the PTRACE_EVENT_* of a ptrace stop (0 for a signal-delivery stop). Unlike
// WaitStatus.TrapCause it also reads the events of stops whose signal is not SIGTRAP
// (under PTRACE_SEIZE a group stop is PTRACE_EVENT_STOP with its stop signal).
func event(ws unix.WaitStatus) int {
	if !ws.Stopped() {
		return -1
	}
	return int(uint32(ws)>>16) & 0xff
}

// wait waits for the next state change of the tracee. It polls, first without
// sleeping (a stop usually follows within microseconds, and a sleeping poll would add
// tens of them to every injected call), then sleeping, so that the timeout holds
// (waitpid itself has none).
func (t *Tracee) wait(timeout time.Duration) (unix.WaitStatus, error) {
	start := time.Now()
	deadline := start.Add(timeout)
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(t.Pid, &ws, unix.WALL|unix.WNOHANG, nil)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("wait for %d: %w", t.Pid, err)
		}
		if pid == t.Pid {
			if ws.Exited() || ws.Signaled() {
				return ws, fmt.Errorf("%d: %w", t.Pid, ErrExited)
			}
			return ws, nil
		}
		now := time.Now()
		if now.After(deadline) {
			return 0, fmt.Errorf("process %d did not stop within %s (state %s)", t.Pid, timeout, procState(t.Pid))
		}
		if now.Sub(start) > 2*time.Millisecond {
			time.Sleep(100 * time.Microsecond)
		}
	}
}

func (t *Tracee) save() error {
	if err := unix.PtraceGetRegs(t.Pid, &t.saved); err != nil {
		return fmt.Errorf("ptrace getregs %d: %w", t.Pid, err)
	}
	restarted(&t.saved)
	return nil
}

// Restart codes a system call interrupted by a stop leaves in rax (include/linux/errno.h).
const (
	errRestartSys          = 512
	errRestartNoIntr       = 513
	errRestartNoHand       = 514
	errRestartRestartBlock = 516
)

// restarted rewrites the registers of a process stopped inside an interrupted system
// call (blocked in read(2), say) into those of the same process about to issue it again:
// what the kernel's restart logic does when the process resumes from a stop in its
// signal path. Done here, the registers are right to resume from any stop, and to give
// to a copy (which resumes from a fork): a process detached from a system-call stop, or
// by the death of its tracer, would otherwise see the restart code as the call's result.
func restarted(r *unix.PtraceRegs) {
	if int64(r.Orig_rax) < 0 {
		return // not in a system call
	}
	switch int64(r.Rax) {
	case -errRestartSys, -errRestartNoIntr, -errRestartNoHand:
		r.Rax = r.Orig_rax
	case -errRestartRestartBlock:
		r.Rax = unix.SYS_RESTART_SYSCALL
	default:
		return
	}
	r.Rip -= 2 // back onto the syscall instruction (0f 05)
	r.Orig_rax = ^uint64(0)
}

// Regs are the tracee's own registers (as saved when it stopped, or as set by SetRegs).
func (t *Tracee) Regs() unix.PtraceRegs { return t.saved }

// SetRegs replaces the tracee's own registers: Restore and Detach put these back.
func (t *Tracee) SetRegs(r unix.PtraceRegs) { t.saved = r }

// Restore writes the tracee's own registers back after injected calls.
func (t *Tracee) Restore() error {
	if err := unix.PtraceSetRegs(t.Pid, &t.saved); err != nil {
		return fmt.Errorf("ptrace setregs %d: %w", t.Pid, err)
	}
	return nil
}

// Detach restores the tracee's registers and lets it run, delivering again the signals
// that arrived while it was stopped.
func (t *Tracee) Detach() error {
	if err := t.Restore(); err != nil {
		return err
	}
	var first uintptr
	rest := t.pending
	if len(rest) > 0 {
		first, rest = uintptr(rest[0]), rest[1:]
	}
	if _, _, errno := unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_DETACH, uintptr(t.Pid), 0, first, 0, 0); errno != 0 {
		return fmt.Errorf("ptrace detach %d: %w", t.Pid, errno)
	}
	for _, s := range rest {
		unix.Kill(t.Pid, s)
	}
	t.pending = nil
	return nil
}

// Kill kills the tracee and waits until it is dead (as its tracer, we are told first).
func (t *Tracee) Kill() error {
	unix.Kill(t.Pid, unix.SIGKILL)
	for {
		ws, err := t.wait(stepTimeout)
		if errors.Is(err, ErrExited) || ws.Exited() || ws.Signaled() {
			return nil
		}
		if err != nil {
			return err
		}
		// A stop reported before the kill took: let it go on to its death.
		unix.PtraceCont(t.Pid, 0)
	}
}

// procState is the state letter of pid from /proc, for error messages.
func procState(pid int) string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return "gone"
	}
	if i := bytes.LastIndexByte(b, ')'); i > 0 && i+2 < len(b) {
		return string(b[i+2 : i+3])
	}
	return "?"
}

// vdsoSyscallOffset is the offset of a `syscall` instruction (0f 05) in this kernel's
// 64-bit vDSO, found once in our own copy: every 64-bit process maps the same image.
var vdsoSyscallOffset = sync.OnceValues(func() (uint64, error) {
	start, end, err := vdsoRange(os.Getpid())
	if err != nil {
		return 0, err
	}
	mem, err := os.Open("/proc/self/mem")
	if err != nil {
		return 0, err
	}
	defer mem.Close()
	img := make([]byte, end-start)
	if _, err := mem.ReadAt(img, int64(start)); err != nil {
		return 0, fmt.Errorf("read our vDSO: %w", err)
	}
	i := bytes.Index(img, []byte{0x0f, 0x05})
	if i < 0 {
		return 0, errors.New("no syscall instruction in the vDSO")
	}
	return uint64(i), nil
})

// vdsoRange returns where pid maps its vDSO.
func vdsoRange(pid int) (start, end uint64, err error) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/maps")
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasSuffix(line, "[vdso]") {
			continue
		}
		lo, hi, ok := strings.Cut(strings.Fields(line)[0], "-")
		if !ok {
			break
		}
		s, err1 := strconv.ParseUint(lo, 16, 64)
		e, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil {
			break
		}
		return s, e, nil
	}
	return 0, 0, fmt.Errorf("process %d maps no vDSO", pid)
}

// locate finds the tracee's syscall instruction (once per tracee).
func (t *Tracee) locate() error {
	if t.syscallAt != 0 {
		return nil
	}
	off, err := vdsoSyscallOffset()
	if err != nil {
		return err
	}
	start, _, err := vdsoRange(t.Pid)
	if err != nil {
		return err
	}
	var insn [2]byte
	if err := t.ReadMem(start+off, insn[:]); err != nil {
		return err
	}
	if insn != [2]byte{0x0f, 0x05} {
		return fmt.Errorf("process %d: its vDSO differs from ours (a 32-bit process?)", t.Pid)
	}
	t.syscallAt = start + off
	return nil
}
