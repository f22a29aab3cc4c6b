package ptrace

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/internal/testenv/prereq"
)

// TestMain lets the test binary act as a tracer that dies (TestTracerDies).
func TestMain(m *testing.M) {
	if pid := os.Getenv(dyingTracerEnv); pid != "" {
		dyingTracer(pid)
	}
	os.Exit(m.Run())
}

// dyingTracerEnv names the process a re-executed test binary traces and then dies on.
const dyingTracerEnv = "CAIRN_PTRACE_DYING_TRACER"

// dyingTracer seizes and stops pid, injects calls into it, forks a copy of it (killed
// at once) and exits without detaching: between two injected calls, as cairn may die.
func dyingTracer(pidStr string) {
	var pid int
	fmt.Sscan(pidStr, &pid)
	tr := NewTracer()
	err := tr.Do(func() error {
		tc, err := seizeStopped(pid)
		if err != nil {
			return err
		}
		if _, err := tc.Syscall(unix.SYS_GETPID); err != nil {
			return err
		}
		z, err := tc.Fork(unix.CLONE_PARENT)
		if err != nil {
			return err
		}
		unix.Kill(z.Pid, unix.SIGKILL)
		if _, err := tc.Syscall(unix.SYS_GETPPID); err != nil {
			return err
		}
		return tc.Restore() // its own registers back, still stopped: then the tracer dies
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	os.Exit(0)
}

// TestTracerDies kills the tracer between injected calls (with the tracee's registers
// its own again, as zygote.Capture leaves them before its slow steps): the kernel
// detaches the tracee, which must carry on as if nothing happened.
func TestTracerDies(t *testing.T) {
	requireRoot(t)
	c := startReplica(t)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), dyingTracerEnv+"="+fmt.Sprint(c.cmd.Process.Pid))
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("tracer: %v: %s", err, out)
	}
	for i := 2; i <= 4; i++ {
		if got := c.ask(t); got[2] != fmt.Sprint(i) {
			t.Fatalf("after its tracer died the replica answered %v, want answer %d", got, i)
		}
	}
}

// TestBetween checks the crash-window gate: Between runs at once after injected calls
// (each puts the registers back), waits while a child forked by an injected clone still
// has the call's registers, and runs once that child is gone.
func TestBetween(t *testing.T) {
	requireRoot(t)
	c, tr, tc := stoppedReplica(t)
	var z *Tracee
	err := tr.Do(func() error {
		_, err := tc.Syscall(unix.SYS_GETPID)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	ran := make(chan struct{})
	go Between(func() { close(ran) })
	select {
	case <-ran:
	case <-time.After(2 * time.Second):
		t.Fatal("Between waited although every injected call had put the registers back")
	}
	if err := tr.Do(func() (err error) { z, err = tc.Fork(unix.CLONE_PARENT); return err }); err != nil {
		t.Fatal(err)
	}
	ran = make(chan struct{})
	go Between(func() { close(ran) })
	select {
	case <-ran:
		t.Fatal("Between ran while a forked child still had the injected call's registers")
	case <-time.After(200 * time.Millisecond):
	}
	if err := tr.Do(func() error {
		if err := z.Kill(); err != nil {
			return err
		}
		return tc.Detach()
	}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ran:
	case <-time.After(2 * time.Second):
		t.Fatal("Between did not run once the forked child was killed")
	}
	if got := c.ask(t); got[2] != "2" {
		t.Fatalf("the replica answered %v after the injections, want answer 2", got)
	}
}

// seizeStopped seizes pid and waits until it is stopped for us. Call it inside Do.
func seizeStopped(pid int) (*Tracee, error) {
	tc, err := Seize(pid)
	if err != nil {
		return nil, err
	}
	if err := tc.Interrupt(); err != nil {
		return nil, err
	}
	return tc, tc.Wait(10 * time.Second)
}

// replica is the tracee of these tests: a single-threaded Python process (a Go test
// binary would not do: fork copies one thread, and the Go runtime needs all of its own)
// that blocks reading commands from fd 3 and answers on fd 4 with its pid, its parent's
// and a counter kept in memory.
const replica = `
import os
n = 0
while True:
    cmd = os.read(3, 64).decode().strip()
    if not cmd:
        break
    n += 1
    os.write(4, ("%d %d %d\n" % (os.getpid(), os.getppid(), n)).encode())
`

type child struct {
	cmd  *exec.Cmd
	in   *os.File // commands (read by every copy of the process)
	out  *bufio.Reader
	outf *os.File
}

func startReplica(t *testing.T) *child {
	t.Helper()
	if _, err := exec.LookPath("python3"); err != nil {
		prereq.Missing(t, "python3 not found")
	}
	cr, cw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	rr, rw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("python3", "-c", replica)
	cmd.ExtraFiles = []*os.File{cr, rw}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	cr.Close()
	rw.Close()
	c := &child{cmd: cmd, in: cw, out: bufio.NewReader(rr), outf: rr}
	t.Cleanup(func() {
		cw.Close()
		rr.Close()
		cmd.Process.Kill()
		cmd.Wait()
	})
	c.ask(t) // wait until Python runs and blocks in its read
	return c
}

// stoppedReplica starts a replica, and a tracer that holds it stopped (closed at the
// test's end).
func stoppedReplica(t *testing.T) (*child, *Tracer, *Tracee) {
	t.Helper()
	c := startReplica(t)
	tr := NewTracer()
	t.Cleanup(tr.Close)
	return c, tr, stop(t, tr, c.cmd.Process.Pid)
}

// ask sends one command and returns the answer's fields.
func (c *child) ask(t *testing.T) []string {
	t.Helper()
	if _, err := c.in.Write([]byte("x\n")); err != nil {
		t.Fatal(err)
	}
	c.outf.SetReadDeadline(time.Now().Add(10 * time.Second))
	line, err := c.out.ReadString('\n')
	if err != nil {
		t.Fatalf("no answer from the replica: %v", err)
	}
	return strings.Fields(line)
}

// waitState waits until pid is in the given state (of /proc/PID/stat).
func waitState(t *testing.T, pid int, state string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ProcState(pid) != state; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("process %d did not reach state %s", pid, state)
		}
	}
}

func requireRoot(t *testing.T) {
	t.Helper()
	prereq.Root(t, "ptrace of arbitrary processes needs root")
}

// stop seizes and stops pid on tr's thread.
func stop(t *testing.T, tr *Tracer, pid int) *Tracee {
	t.Helper()
	var tc *Tracee
	err := tr.Do(func() (err error) {
		tc, err = seizeStopped(pid)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return tc
}

// TestSyscallInBlockedProcess injects calls into a process blocked in read(2): their
// results are right, and the read it was blocked in carries on unaware afterwards.
func TestSyscallInBlockedProcess(t *testing.T) {
	requireRoot(t)
	c, tr, tc := stoppedReplica(t)
	pid := c.cmd.Process.Pid
	before := tc.Regs()
	err := tr.Do(func() error {
		got, err := tc.Syscall(unix.SYS_GETPID)
		if err != nil {
			return err
		}
		if int(got) != pid {
			return fmt.Errorf("getpid in the tracee = %d, want %d", got, pid)
		}
		// A failing call reports its errno.
		if _, err := tc.Syscall(unix.SYS_CLOSE, 9999); err != unix.EBADF {
			return fmt.Errorf("close(9999) in the tracee: %v, want EBADF", err)
		}
		// Scratch memory: write a message there and have the tracee write it to fd 4.
		s, err := tc.MapScratch(100)
		if err != nil {
			return err
		}
		msg := []byte("0 0 injected\n")
		addr, err := s.Put(0, msg)
		if err != nil {
			return err
		}
		if n, err := tc.Syscall(unix.SYS_WRITE, 4, addr, uintptr(len(msg))); err != nil || int(n) != len(msg) {
			return fmt.Errorf("write in the tracee: %d, %v", n, err)
		}
		if err := s.Free(); err != nil {
			return err
		}
		return tc.Detach()
	})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(before, tc.Regs()); diff != "" {
		t.Errorf("saved registers changed (-before +after):\n%s", diff)
	}
	c.outf.SetReadDeadline(time.Now().Add(10 * time.Second))
	if line, err := c.out.ReadString('\n'); err != nil || line != "0 0 injected\n" {
		t.Fatalf("injected write: %q, %v", line, err)
	}
	// The interrupted read(2) restarted: the next command is answered as the second.
	if got := c.ask(t); got[2] != "2" {
		t.Fatalf("after injection the replica answered %v, want its second answer", got)
	}
}

// TestBorrowStack has an injected call write into bytes lent by the tracee's stack:
// the call's result is there, and once they are given back the stack holds what it held
// and the tracee goes on answering.
func TestBorrowStack(t *testing.T) {
	requireRoot(t)
	c, tr, tc := stoppedReplica(t)
	pid := c.cmd.Process.Pid
	err := tr.Do(func() error {
		rsp := tc.Regs().Rsp
		before := make([]byte, 64)
		if err := tc.ReadMem(rsp, before); err != nil {
			return err
		}
		s, err := tc.BorrowStack(32)
		if err != nil {
			return err
		}
		if s.Addr != rsp {
			return fmt.Errorf("borrowed %#x, want the stack pointer %#x", s.Addr, rsp)
		}
		// getrlimit(RLIMIT_NOFILE) writes 16 bytes there: the limits the process has.
		if _, err := tc.Syscall(unix.SYS_GETRLIMIT, unix.RLIMIT_NOFILE, uintptr(s.Addr)); err != nil {
			return err
		}
		var got unix.Rlimit
		if err := s.Get(0, Bytes(&got)); err != nil {
			return err
		}
		var want unix.Rlimit
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/limits", pid))
		if err != nil {
			return err
		}
		for _, l := range strings.Split(string(b), "\n") {
			if f := strings.Fields(l); len(f) >= 6 && f[1] == "open" {
				fmt.Sscan(f[3], &want.Cur)
				fmt.Sscan(f[4], &want.Max)
			}
		}
		if got != want {
			return fmt.Errorf("getrlimit into borrowed stack bytes: %+v, want %+v", got, want)
		}
		if err := s.Free(); err != nil {
			return err
		}
		after := make([]byte, 64)
		if err := tc.ReadMem(rsp, after); err != nil {
			return err
		}
		if !bytes.Equal(before, after) {
			return fmt.Errorf("the stack was not given back:\n before %x\n after  %x", before, after)
		}
		return tc.Detach()
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := c.ask(t); got[2] != "2" {
		t.Fatalf("after the borrow the replica answered %v, want its second answer", got)
	}
}

// TestForkCopiesProcess makes the tracee fork a copy with CLONE_PARENT, gives the copy
// the tracee's own registers, and lets both run: both answer, each with its own PID, the
// same parent, and a counter that went on from the same value in each.
func TestForkCopiesProcess(t *testing.T) {
	requireRoot(t)
	c := startReplica(t)
	pid := c.cmd.Process.Pid
	c.ask(t) // counter 2
	tr := NewTracer()
	defer tr.Close()
	tc := stop(t, tr, pid)
	var copyPid int
	err := tr.Do(func() error {
		z, err := tc.Fork(unix.CLONE_PARENT)
		if err != nil {
			return err
		}
		copyPid = z.Pid
		if z.ClonedAs != z.Pid { // the same pid namespace as ours
			return fmt.Errorf("the clone returned %d to the process, want the copy's PID %d", z.ClonedAs, z.Pid)
		}
		return runBoth(tc, z)
	})
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Kill(copyPid, unix.SIGKILL)
	// Both read the same pipe: let one at a time run.
	only := func(run, stopped int) []string {
		unix.Kill(stopped, unix.SIGSTOP)
		waitState(t, stopped, "T")
		unix.Kill(run, unix.SIGCONT)
		return c.ask(t)
	}
	got := [][]string{only(pid, copyPid), only(copyPid, pid)}
	unix.Kill(pid, unix.SIGCONT)
	want := [][]string{{fmt.Sprint(pid), fmt.Sprint(os.Getpid()), "3"}, {fmt.Sprint(copyPid), fmt.Sprint(os.Getpid()), "3"}}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("answers of the process and its copy (-want +got):\n%s", diff)
	}
	// The copy is our child now (CLONE_PARENT): reap it.
	unix.Kill(copyPid, unix.SIGKILL)
	var ws unix.WaitStatus
	if _, err := unix.Wait4(copyPid, &ws, 0, nil); err != nil {
		t.Fatalf("the copy is not a child of the tracee's parent: %v", err)
	}
	if !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("copy ended with %v", ws)
	}
}

// TestForkedCopyStaysStopped checks what zygotes rely on: a copy made and left stopped
// (SIGSTOP queued before detaching) runs no instruction until continued, and its memory
// is its own.
func TestForkedCopyStaysStopped(t *testing.T) {
	requireRoot(t)
	c, tr, tc := stoppedReplica(t)
	pid := c.cmd.Process.Pid
	var copyPid int
	err := tr.Do(func() error {
		z, err := tc.Fork(unix.CLONE_PARENT)
		if err != nil {
			return err
		}
		copyPid = z.Pid
		z.SetRegs(tc.Regs())
		unix.Kill(z.Pid, unix.SIGSTOP)
		if err := z.Detach(); err != nil {
			return err
		}
		return tc.Detach()
	})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { unix.Kill(copyPid, unix.SIGKILL); unix.Wait4(copyPid, nil, 0, nil) }()
	for i := 2; i <= 4; i++ {
		if got := c.ask(t); got[0] != fmt.Sprint(pid) || got[2] != fmt.Sprint(i) {
			t.Fatalf("answer %d came from %v, want the original process %d", i, got, pid)
		}
	}
	waitState(t, copyPid, "T") // it stops once it runs (on a loaded machine, not at once)
	// Continued (and the original stopped, so that only the copy reads), the copy
	// answers with the counter it had at the fork.
	unix.Kill(pid, unix.SIGSTOP)
	defer unix.Kill(pid, unix.SIGCONT)
	waitState(t, pid, "T")
	unix.Kill(copyPid, unix.SIGCONT)
	if got := c.ask(t); got[0] != fmt.Sprint(copyPid) || got[2] != "2" {
		t.Fatalf("continued copy answered %v, want pid %d with counter 2", got, copyPid)
	}
}

// TestColocate checks that a tracee runs on its tracer's CPU only while it is traced,
// and gets its own CPU affinity back when detached: the one it had (here set by the
// test to the CPU that is not the tracer's, to tell it from both). A copy made by Fork
// is born with its parent's own (the clone ran unpinned), is pinned by a call injected
// into it, and gets its parent's own back when detached.
func TestColocate(t *testing.T) {
	requireRoot(t)
	if runtime.NumCPU() < 2 {
		t.Skip("needs two CPUs")
	}
	c := startReplica(t)
	pid := c.cmd.Process.Pid
	var own unix.CPUSet
	tr := NewTracer()
	defer tr.Close()
	affinity := func(pid int) unix.CPUSet {
		var s unix.CPUSet
		if err := unix.SchedGetaffinity(pid, &s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	var copyPid int
	var tracing, stopped, pinned, copyBorn, copyPinned unix.CPUSet
	err := tr.Do(func() error {
		// The tracer's thread stays on its CPU for the length of the Do.
		cpu, err := currentCPU()
		if err != nil {
			return err
		}
		tracing.Set(cpu)
		own.Set(1 - cpu%2) // not the tracer's
		if err := unix.SchedSetaffinity(pid, &own); err != nil {
			return err
		}
		tc, err := seizeStopped(pid)
		if err != nil {
			return err
		}
		stopped = affinity(pid)
		if _, err := tc.Syscall(unix.SYS_GETPID); err != nil {
			return err
		}
		pinned = affinity(pid)
		z, err := tc.Fork(unix.CLONE_PARENT)
		if err != nil {
			return err
		}
		copyPid = z.Pid
		copyBorn = affinity(z.Pid)
		if _, err := z.Syscall(unix.SYS_GETPID); err != nil {
			return err
		}
		copyPinned = affinity(z.Pid)
		return runBoth(tc, z)
	})
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Kill(copyPid, unix.SIGKILL)
	if stopped != tracing || pinned != tracing || copyPinned != tracing {
		t.Errorf("while traced: affinity %v once stopped, %v after a call, its copy's %v; want %v (the tracer's CPU)", stopped, pinned, copyPinned, tracing)
	}
	if copyBorn != own {
		t.Errorf("the copy was born with affinity %v, want its parent's own %v (a clone runs unpinned)", copyBorn, own)
	}
	if got := affinity(pid); got != own {
		t.Errorf("after Detach the process's affinity is %v, want its own %v", got, own)
	}
	if got := affinity(copyPid); got != own {
		t.Errorf("after Detach the copy's affinity is %v, want its parent's own %v", got, own)
	}
	// It reads the same pipe: dead (reaped, it is our child) before the process is
	// asked, or, killed on its way into its read, it could still take the question.
	unix.Kill(copyPid, unix.SIGKILL)
	unix.Wait4(copyPid, nil, 0, nil)
	// The process runs on as before.
	if got := c.ask(t); len(got) != 3 || got[2] != "2" {
		t.Errorf("the process answers %v after being traced", got)
	}
}

// runBoth gives the copy z the registers of the process tc it was forked from, and
// detaches both: they run on as two copies.
func runBoth(tc, z *Tracee) error {
	z.SetRegs(tc.Regs())
	if err := z.Detach(); err != nil {
		return err
	}
	return tc.Detach()
}

// TestSetVDSO: told where the tracee's vDSO starts, a tracee finds the syscall
// instruction its own maps read would find; told a wrong address, it refuses it and
// still finds the instruction itself at its first injected call.
func TestSetVDSO(t *testing.T) {
	requireRoot(t)
	c, tr, tc := stoppedReplica(t)
	pid := c.cmd.Process.Pid
	start, _, err := vdsoRange(pid)
	if err != nil {
		t.Fatal(err)
	}
	err = tr.Do(func() error {
		if err := tc.SetVDSO(0x1000); err == nil {
			return fmt.Errorf("SetVDSO(0x1000) accepted an unmapped address")
		}
		if tc.syscallAt != 0 {
			return fmt.Errorf("a refused SetVDSO left syscallAt %#x", tc.syscallAt)
		}
		if got, err := tc.Syscall(unix.SYS_GETPID); err != nil || int(got) != pid {
			return fmt.Errorf("getpid after a refused SetVDSO: %d, %v", got, err)
		}
		found := tc.syscallAt
		tc.syscallAt = 0
		if err := tc.SetVDSO(start); err != nil {
			return err
		}
		if tc.syscallAt != found {
			return fmt.Errorf("SetVDSO(%#x) gave the syscall instruction at %#x, its maps %#x", start, tc.syscallAt, found)
		}
		if got, err := tc.Syscall(unix.SYS_GETPID); err != nil || int(got) != pid {
			return fmt.Errorf("getpid after SetVDSO: %d, %v", got, err)
		}
		return tc.Detach()
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := c.ask(t); got[0] != strconv.Itoa(pid) {
		t.Errorf("the replica answered %v after the calls", got)
	}
}

// TestDropPending: a signal that arrives while a tracee is stopped for us is held back
// (noted when an injected call meets it) and delivered by Detach, unless dropped: a
// SIGUSR1, which ends the replica, dropped, leaves it answering.
func TestDropPending(t *testing.T) {
	requireRoot(t)
	for _, drop := range []bool{false, true} {
		c, tr, tc := stoppedReplica(t)
		pid := c.cmd.Process.Pid
		if err := unix.Kill(pid, unix.SIGUSR1); err != nil {
			t.Fatal(err)
		}
		err := tr.Do(func() error {
			if got, err := tc.Syscall(unix.SYS_GETPID); err != nil || int(got) != pid {
				return fmt.Errorf("getpid with a signal pending: %d, %v", got, err)
			}
			if drop {
				tc.DropPending()
			}
			return tc.Detach()
		})
		if err != nil {
			t.Fatal(err)
		}
		if drop {
			if got := c.ask(t); got[0] != strconv.Itoa(pid) {
				t.Errorf("after the signal was dropped, the replica answered %v", got)
			}
			continue
		}
		err = c.cmd.Wait()
		if ws, ok := c.cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != unix.SIGUSR1 {
			t.Errorf("not dropped, the signal did not end the replica: %v", err)
		}
	}
}

// handler is a Python process that handles SIGUSR1 and SIGUSR2 while it waits in
// pause(2), and writes to fd 4 the signals its handlers ran for, as their
// Python-level handlers see them (run once pause returns).
const handler = `
import os, signal
got = []
def h(n, f):
    got.append(n)
    os.write(4, ("%s\n" % sorted(got)).encode())
signal.signal(signal.SIGUSR1, h)
signal.signal(signal.SIGUSR2, h)
os.write(4, b"ready\n")
while True:
    signal.pause()
`

// TestSignalsWhileStopped: signals sent to a process while it is stopped for us, in a
// blocking call with handlers for them, run those handlers once it is detached (its
// call fails with EINTR, as it would have without us), whether the tracer saw them
// during an injected call, or they are pending when it detaches, from the stop it was
// seized in or from an injected call's exit.
func TestSignalsWhileStopped(t *testing.T) {
	requireRoot(t)
	for _, c := range []struct {
		name   string
		before bool // injected call after the signals (they are seen by the tracer)
		after  bool // injected call before the signals (pending at the detach)
	}{{"seen during a call", true, false}, {"pending at an event stop", false, false}, {"pending at a call's exit", false, true}} {
		t.Run(c.name, func(t *testing.T) {
			rr, rw, err := os.Pipe()
			if err != nil {
				t.Fatal(err)
			}
			defer rr.Close()
			cmd := exec.Command("python3", "-c", handler)
			cmd.ExtraFiles = []*os.File{nil, rw} // fd 4
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			rw.Close()
			defer func() { cmd.Process.Kill(); cmd.Wait() }()
			out := bufio.NewReader(rr)
			line := func() string {
				rr.SetReadDeadline(time.Now().Add(5 * time.Second))
				l, _ := out.ReadString('\n')
				return strings.TrimSpace(l)
			}
			if l := line(); l != "ready" {
				t.Fatalf("the process said %q, want ready", l)
			}
			waitState(t, cmd.Process.Pid, "S")
			tr := NewTracer()
			defer tr.Close()
			tc := stop(t, tr, cmd.Process.Pid)
			err = tr.Do(func() error {
				if c.after {
					if _, err := tc.Syscall(unix.SYS_GETPID); err != nil {
						return err
					}
				}
				unix.Kill(cmd.Process.Pid, unix.SIGUSR2)
				unix.Kill(cmd.Process.Pid, unix.SIGUSR1)
				if c.before {
					if _, err := tc.Syscall(unix.SYS_GETPID); err != nil {
						return err
					}
				}
				return tc.Detach()
			})
			if err != nil {
				t.Fatal(err)
			}
			want := fmt.Sprintf("[%d, %d]", unix.SIGUSR1, unix.SIGUSR2)
			var got []string
			for l := line(); l != ""; l = line() {
				if got = append(got, l); l == want {
					return
				}
			}
			t.Fatalf("the handlers reported %q, want %s at last", got, want)
		})
	}
}

// TestInjectedCallWaits: the tracer waits for an injected call that takes a while (a
// nanosleep of 300 ms, blocked in the kernel) and gets its result; a call that does not
// return within stepTimeout (pause) kills its process, which would otherwise run on
// from registers not its own, and says so.
func TestInjectedCallWaits(t *testing.T) {
	requireRoot(t)
	c, tr, tc := stoppedReplica(t)
	defer func(d time.Duration) { stepTimeout = d }(stepTimeout)
	stepTimeout = 5 * time.Second
	err := tr.Do(func() error {
		s, err := tc.MapScratch(16)
		if err != nil {
			return err
		}
		ts := unix.NsecToTimespec(int64(300 * time.Millisecond))
		addr, err := s.Put(0, Bytes(&ts))
		if err != nil {
			return err
		}
		start := time.Now()
		if _, err := tc.Syscall(unix.SYS_NANOSLEEP, addr, 0); err != nil {
			return fmt.Errorf("nanosleep of 300 ms in the tracee: %w", err)
		}
		if d := time.Since(start); d < 300*time.Millisecond {
			return fmt.Errorf("the injected nanosleep of 300 ms returned after %v", d)
		}
		if err := s.Free(); err != nil {
			return err
		}
		stepTimeout = 300 * time.Millisecond
		_, err = tc.Syscall(unix.SYS_PAUSE)
		if err == nil || !strings.Contains(err.Error(), "killed") {
			return fmt.Errorf("pause injected with a timeout of %v: %v, want a timeout that killed it", stepTimeout, err)
		}
		t.Logf("pause: %v", err)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// Dead: reaped by the tracer's wait (the test is also its parent), or a zombie.
	pid := c.cmd.Process.Pid
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if st := ProcState(pid); st == "gone" || st == "Z" {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("the tracee whose injected call timed out is still alive (state %s)", st)
		}
	}
}
