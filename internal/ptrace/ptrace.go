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
// CPUs. While traced, a tracee runs on its tracer's CPU (colocate.go): an injected call
// is two round trips between them, and a wake-up of an idle CPU of a virtual machine
// costs more than the call.
//
// Crash windows. While a system call is being injected the tracee's registers are not
// its own. If the tracer dies in that window the kernel detaches the tracee, which then
// runs on from the injected state and most likely crashes. Each window lasts one system
// call (tens of microseconds): the registers are put back after every call. A child
// forked by an injected clone is born in such a window, which lasts until it is given
// registers (SetRegs, then Restore or Detach) or killed. Between runs a function
// outside every window of the process (a test's crash point placed in code that runs
// concurrently with injections, so that where it kills is deterministic).
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
	"unsafe"

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
		// wait's short sleeps: without this a nanosleep of the thread lasts at least the
		// default 50 µs of timer slack.
		unix.Prctl(unix.PR_SET_TIMERSLACK, 1, 0, 0, 0)
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
				pinned := pinThread()
				f()
				if pinned {
					unpinThread()
				}
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
func (t *Tracer) Forget(tc *Tracee) {
	tc.setInjected(false) // it never ran an injected call
	t.stale = append(t.stale, tc)
}

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
			tc.unpin()
			unix.PtraceDetach(tc.Pid)
		default:
			keep = append(keep, tc)
		}
	}
	t.stale = keep
}

// Do runs f on the tracer's thread and returns its error. While f runs the thread stays
// on the CPU it started on, where its tracees run their injected calls (see colocate).
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
	// ClonedAs is, for a copy made by Fork, the PID the clone returned to its parent: the
	// copy's PID in the parent's pid namespace (0 for a seized process).
	ClonedAs int
	// saved are the tracee's own registers, read when it stopped; Restore puts them back.
	saved unix.PtraceRegs
	// interrupted, if the tracee stopped inside a system call that the stop interrupted,
	// are its registers as read then, before restarted rewrote them in saved: Detach
	// writes these back where the kernel's own restart logic runs as the tracee resumes
	// (it restarts the call, or makes it fail with EINTR for a signal's handler, as the
	// call asked). Nil once SetRegs or Park replaced the registers.
	interrupted *unix.PtraceRegs
	// sysStop says the tracee is in the exit stop of an injected call (not in the
	// event stop Wait saw), from which the kernel's restart logic runs only if a signal
	// is pending.
	sysStop bool
	// syscallAt is the address of a `syscall` instruction in the tracee's vDSO.
	syscallAt uint64
	// pending are signals that arrived while the tracee was stopped for us; Detach
	// delivers them again.
	pending []syscall.Signal
	// injected says that the tracee's registers are not its own (a crash window, counted
	// in windows).
	injected bool
	// parked holds the tracee's own registers while it is parked (Park); saved then
	// holds the parking call.
	parked *unix.PtraceRegs
	// pinned says the tracee runs on its tracer's CPU only (colocate); mask is its own
	// CPU affinity, which Detach gives back.
	pinned bool
	mask   unix.CPUSet
}

// windows counts the tracees (and Window calls) in a crash window, process-wide.
var windows struct {
	mu sync.Mutex
	n  int
}

// betweenWait bounds how long Between waits for the windows to close: a tracee lost in
// one (an error path that neither restored nor killed it) must not hang a test.
const betweenWait = 5 * time.Second

// Between runs f while no tracee of this process is in a crash window, and holds every
// window shut while f runs: f may kill the process. It waits at most a few seconds for
// open windows to close, then runs f anyway. It polls: it serves tests' crash points.
func Between(f func()) {
	deadline := time.Now().Add(betweenWait)
	windows.mu.Lock()
	for windows.n > 0 && time.Now().Before(deadline) {
		windows.mu.Unlock()
		time.Sleep(100 * time.Microsecond)
		windows.mu.Lock()
	}
	defer windows.mu.Unlock()
	f()
}

// Window runs f as a crash window of the caller's own (Between waits for it to end):
// state that must not outlive a crash of this process while f runs, beyond a tracee's
// registers (say, a pid namespace's next PID lowered for an injected fork).
func Window(f func() error) error {
	openWindows(1)
	defer openWindows(-1)
	return f()
}

func openWindows(d int) {
	windows.mu.Lock()
	windows.n += d
	windows.mu.Unlock()
}

// setInjected opens or closes the tracee's crash window.
func (t *Tracee) setInjected(on bool) {
	if t.injected == on {
		return
	}
	t.injected = on
	if on {
		openWindows(1)
	} else {
		openWindows(-1)
	}
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
// it is thawed. The tracee is colocated first (colocate): woken on the tracer's CPU,
// which the tracer leaves to it while it waits, it stops there at once; woken on the
// other CPU, it queued behind whatever ran there beside the stop (a rollback's revert
// plan, a checkpoint's preparation). See wait for the figures.
func (t *Tracee) Interrupt() error {
	t.colocate()
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
	return t.waitStop(timeout, t.wait)
}

// waitStop is Wait, its waits made by wait (wait, or waitRun for a child of an
// injected clone).
func (t *Tracee) waitStop(timeout time.Duration, wait func(time.Duration) (unix.WaitStatus, error)) error {
	for {
		ws, err := wait(timeout)
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

// wait waits for the next state change of the tracee: a stop Interrupt asked for, which
// a process in an uninterruptible sleep may not reach in time (injected calls wait with
// waitRun instead). It polls (waitpid has no timeout), in nanosleeps of its own thread
// of ~20 µs, after 5 ms in sleeps of the Go scheduler. A tracee not on the tracer's
// CPU is polled for without sleeping first (spinFor).
//
// A tracee on the tracer's CPU (colocate, as every tracee from Interrupt on) needs that
// CPU to reach its stop: the tracer sleeps between polls, and the CPU is the tracee's.
// It used to yield it instead (sched_yield), which gives it to the tracee only when the
// scheduler deems the tracee due: after it had run its share, not before the next tick.
// BenchmarkStop (two sleeping processes stopped beside a busy goroutine, as a
// rollback's revert plan is beside its stop): colocated and sleeping, 57-74 µs p50,
// 181-205 µs p99; not colocated (the tracee woken on the busy CPU, as before
// 2026-12-06), 92-129 µs p50, 2.9-4.0 ms p99; colocated and yielding, 4.0 ms p99.
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
			return 0, fmt.Errorf("process %d did not stop within %s (state %s)", t.Pid, timeout, ProcState(t.Pid))
		}
		switch waited := now.Sub(start); {
		case !t.pinned && waited < spinFor:
		case waited < 5*time.Millisecond:
			ts := unix.NsecToTimespec(int64(pollEvery))
			unix.Nanosleep(&ts, nil)
		default:
			time.Sleep(100 * time.Microsecond)
		}
	}
}

// waitRun waits for the next state change of a tracee that the tracer resumed into work
// of its own making: an injected call (step), or the first stop of a child an injected
// clone made (Fork). Such a tracee stops again within microseconds (milliseconds for a
// clone of a large process), so the tracer blocks in the kernel until it does, instead
// of polling as wait does: it then takes no CPU from the tracee, which runs on its CPU
// (colocate), and is woken by the stop itself. W1 (`cairn bench --workload w1
// --iterations 20 --seed 7 --no-baselines`), five alternating pairs: checkpoint p99
// 8.0-12.4 ms against 15.5-21.6 with wait's polling (p50 6.65 against 6.88 on
// average), the longest injected calls of a checkpoint's scan 3.6-6.7 ms against
// 3.3-11.5, the new zygotes' two calls 0.12-0.17 ms p50 against 0.19-0.30.
//
// A blocking wait has no timeout of its own: if the tracee has not stopped within
// timeout, a watchdog kills it (SIGKILL), which ends the wait, and waitRun reports the
// timeout. A process stuck inside a call injected into it cannot be given its own
// registers back, and would run on from the injected ones if detached; the polling wait
// (until 2026-12-06) gave up on it without stopping it. (A task in an uninterruptible
// sleep dies only when it leaves it: the tracer waits until then.) The blocking wait
// does not consume the state change (WNOWAIT): the watchdog is disarmed while the
// tracee still holds its PID, even if it exited, so that a late watchdog never kills a
// PID reused since; a non-blocking wait then consumes it.
func (t *Tracee) waitRun(timeout time.Duration) (unix.WaitStatus, error) {
	killed := make(chan struct{})
	watchdog := time.AfterFunc(timeout, func() {
		defer close(killed)
		unix.Kill(t.Pid, unix.SIGKILL)
	})
	var info unix.Siginfo
	var err error
	for {
		err = unix.Waitid(unix.P_PID, t.Pid, &info, unix.WEXITED|unix.WSTOPPED|unix.WALL|unix.WNOWAIT, nil)
		if err != unix.EINTR {
			break
		}
	}
	// A watchdog that fired, or is firing, is waited for: its kill never comes after
	// this returns (the call may have ended just in time: it is killed anyway).
	timedOut := !watchdog.Stop()
	if timedOut {
		<-killed
	}
	if err != nil {
		return 0, fmt.Errorf("wait for %d: %w", t.Pid, err)
	}
	ws, err := t.wait(timeout) // there is a state change to consume: no poll
	if timedOut {
		return ws, fmt.Errorf("process %d did not stop within %s: killed (it was inside a call injected into it)", t.Pid, timeout)
	}
	return ws, err
}

// The polling of wait: it spins for spinFor, then sleeps pollEvery at a time.
const (
	spinFor   = 50 * time.Microsecond
	pollEvery = 20 * time.Microsecond
)

func (t *Tracee) save() error {
	if err := unix.PtraceGetRegs(t.Pid, &t.saved); err != nil {
		return fmt.Errorf("ptrace getregs %d: %w", t.Pid, err)
	}
	t.interrupted, t.sysStop = nil, false
	if r := t.saved; restarted(&t.saved) {
		t.interrupted = &r
	}
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
// It reports whether it rewrote them.
func restarted(r *unix.PtraceRegs) bool {
	if int64(r.Orig_rax) < 0 {
		return false // not in a system call
	}
	switch int64(r.Rax) {
	case -errRestartSys, -errRestartNoIntr, -errRestartNoHand:
		r.Rax = r.Orig_rax
	case -errRestartRestartBlock:
		r.Rax = unix.SYS_RESTART_SYSCALL
	default:
		return false
	}
	r.Rip -= 2 // back onto the syscall instruction (0f 05)
	r.Orig_rax = ^uint64(0)
	return true
}

// Regs are the tracee's own registers (as saved when it stopped, or as set by SetRegs).
func (t *Tracee) Regs() unix.PtraceRegs {
	if t.parked != nil {
		return *t.parked
	}
	return t.saved
}

// SetRegs replaces the tracee's own registers: Restore and Detach put these back (once
// Unpark has, if the tracee is parked).
func (t *Tracee) SetRegs(r unix.PtraceRegs) {
	t.interrupted = nil
	if t.parked != nil {
		t.parked = &r
		return
	}
	t.saved = r
}

// Park makes the registers the tracee would resume from, if its tracer died, those of
// a call of pause(2) at its syscall instruction: until Unpark, a tracee that must not run
// its own code unattended (a frozen template process thawed to be worked on, or its
// fresh copy) waits there instead, where a later tracer finds it and gives it its own
// registers back (SetRegs). Injected calls work as usual meanwhile.
func (t *Tracee) Park() error {
	if t.parked != nil {
		return nil
	}
	if err := t.locate(); err != nil {
		return err
	}
	own := t.saved
	t.interrupted = nil
	r := own
	r.Rip = t.syscallAt
	r.Rax = unix.SYS_PAUSE
	r.Orig_rax = ^uint64(0)
	t.saved, t.parked = r, &own
	return t.Restore()
}

// Parked reports whether the tracee, as it stopped, was waiting in the call Park sets
// up (a tracer parked it, then died).
func (t *Tracee) Parked() bool {
	if t.locate() != nil {
		return false
	}
	// Stopped inside pause(2), its registers read as about to issue it again (restarted).
	return t.saved.Rip == t.syscallAt && t.saved.Rax == unix.SYS_PAUSE
}

// Unpark makes the tracee's own registers the ones Restore and Detach write back again.
func (t *Tracee) Unpark() {
	if t.parked != nil {
		t.saved, t.parked = *t.parked, nil
	}
}

// Restore writes the tracee's own registers back after injected calls.
func (t *Tracee) Restore() error {
	if err := unix.PtraceSetRegs(t.Pid, &t.saved); err != nil {
		if errors.Is(err, unix.ESRCH) && ProcState(t.Pid) == "gone" {
			t.setInjected(false) // dead and reaped: no window any more
		}
		return fmt.Errorf("ptrace setregs %d: %w", t.Pid, err)
	}
	t.setInjected(false)
	return nil
}

// Detach restores the tracee's registers and lets it run, delivering again the signals
// that arrived while it was stopped.
//
// A tracee stopped inside a system call (blocked in read(2), say) must resume as it
// would have without us: restarting the call, or, if a signal with a handler is
// delivered as it resumes, with the call failing with EINTR (unless SA_RESTART). A
// restarted call would go back to sleep with the handler run, and a program that acts
// on its signals after the call returns (a Python REPL: its handlers run between
// bytecodes) would never see them. So the signals noted are queued again (kill) before
// the detach, and the tracee gets back the registers of the interrupted call, for the
// kernel's restart logic, wherever that logic runs as it resumes: from the stop Wait
// saw, always; from an injected call's exit stop, only with a signal pending (else
// the call's restart code would be its result: there it gets the restarted registers).
// A signal that arrives between that check and the detach (microseconds) is delivered,
// but the call is restarted after its handler.
func (t *Tracee) Detach() error {
	if t.interrupted != nil && t.parked == nil && (len(t.pending) > 0 || !t.sysStop || t.signalPending()) {
		t.saved = *t.interrupted
	}
	if err := t.Restore(); err != nil {
		return err
	}
	t.unpin()
	for _, s := range t.pending {
		unix.Kill(t.Pid, s)
	}
	t.pending = nil
	if _, _, errno := unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_DETACH, uintptr(t.Pid), 0, 0, 0, 0); errno != 0 {
		return fmt.Errorf("ptrace detach %d: %w", t.Pid, errno)
	}
	return nil
}

// signalPending reports whether the tracee has a signal pending that it does not block:
// in its own queue or its process's (PTRACE_PEEKSIGINFO), against its mask
// (PTRACE_GETSIGMASK). A few microseconds, where reading /proc/<pid>/status took ~45.
func (t *Tracee) signalPending() bool {
	var blocked uint64
	if _, _, errno := unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_GETSIGMASK, uintptr(t.Pid), 8, uintptr(unsafe.Pointer(&blocked)), 0, 0); errno != 0 {
		return false
	}
	var buf [16]unix.Siginfo
	for _, flags := range []uint32{0, unix.PTRACE_PEEKSIGINFO_SHARED} {
		args := struct {
			off   uint64
			flags uint32
			nr    int32
		}{0, flags, int32(len(buf))}
		for {
			n, _, errno := unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_PEEKSIGINFO, uintptr(t.Pid), uintptr(unsafe.Pointer(&args)), uintptr(unsafe.Pointer(&buf[0])), 0, 0)
			if errno != 0 || n == 0 {
				break
			}
			for _, si := range buf[:n] {
				if si.Signo > 0 && blocked&(1<<(si.Signo-1)) == 0 {
					return true
				}
			}
			args.off += uint64(n)
		}
	}
	return false
}

// DropPending forgets the signals that arrived while the tracee was stopped for us:
// Detach will not deliver them.
func (t *Tracee) DropPending() { t.pending = nil }

// Kill kills the tracee and waits until it is dead (as its tracer, we are told first).
func (t *Tracee) Kill() error {
	unix.Kill(t.Pid, unix.SIGKILL)
	t.setInjected(false) // it runs no instruction of its own any more
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

// ProcState is the state letter of pid in /proc/<pid>/stat ("R", "S", "T", "Z", ...),
// "gone" if it has no entry there.
func ProcState(pid int) string {
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
	start, _, err := vdsoRange(t.Pid)
	if err != nil {
		return err
	}
	return t.SetVDSO(start)
}

// SetVDSO tells the tracee where its vDSO starts, as the caller read it from the
// tracee's maps while it was stopped: the first injected call then need not read the
// maps again (a Python process's took 0.24 ms p50 here, one per process on each
// checkpoint and rewind). The syscall instruction found there is checked; an error
// leaves the tracee to find it itself.
func (t *Tracee) SetVDSO(start uint64) error {
	off, err := vdsoSyscallOffset()
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
