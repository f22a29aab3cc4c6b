package zygote

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/internal/ptrace"
	"github.com/cairn-sandbox/cairn/isolation"
	"github.com/cairn-sandbox/cairn/isolation/container/freezer"
)

// TestCaptureRetriesEnding: a process listed, then gone before the capture stops it (a
// shell and its child killed together, conformance ResidentPaths), is not a reason to
// give up the zygotes: the capture is tried again and does not see it.
func TestCaptureRetriesEnding(t *testing.T) {
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil { // exited and reaped: its PID is gone
		t.Fatal(err)
	}
	gone := cmd.Process.Pid
	self, err := isolation.ProcOf(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	calls := 0
	tr := ptrace.NewTracer()
	defer tr.Close()
	dir := t.TempDir()
	rec, err := Capture(context.Background(), tr, CaptureOptions{
		Init: self,
		Procs: func() ([]int, error) {
			calls++
			if calls == 1 {
				return []int{gone}, nil
			}
			return nil, nil
		},
		CgroupDir: filepath.Join(dir, "cgroups"),
		RecordDir: dir,
	})
	if err != nil {
		t.Fatalf("Capture: %v (after %d listings)", err, calls)
	}
	if calls < 2 || len(rec.Procs) != 0 {
		t.Fatalf("Capture listed the processes %d times and recorded %d, want a second listing and none", calls, len(rec.Procs))
	}
}

// captureCmd starts cmd (leading its own session, its descriptors on the root's mount,
// as a sandbox's processes do), runs before once it started, and captures it as the
// only process of a sandbox whose init is the test, in real freezer cgroups; frozen
// runs as the capture's Frozen (each hook if set). Procs lists cmd until it is gone.
func captureCmd(t *testing.T, cmd *exec.Cmd, before, frozen func(child int)) (*Record, error) {
	t.Helper()
	return captureCmds(t, []*exec.Cmd{cmd}, func() {
		if before != nil {
			before(cmd.Process.Pid)
		}
	}, func() {
		if frozen != nil {
			frozen(cmd.Process.Pid)
		}
	}, nil)
}

// captureCmds is captureCmd for the processes of several commands (Procs lists those
// not gone), with phase (if set) as the capture's Phase.
func captureCmds(t *testing.T, cmds []*exec.Cmd, before, frozen func(), phase func(string, time.Duration)) (*Record, error) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (ptrace, cgroups)")
	}
	// Descriptors on the root's mount only (not /dev/null), as a capture requires.
	dir := t.TempDir()
	f, err := os.Create(filepath.Join(dir, "out"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// Nor any the test binary inherited open across exec (its caller's).
	if ents, err := os.ReadDir("/proc/self/fd"); err == nil {
		for _, e := range ents {
			if n, err := strconv.Atoi(e.Name()); err == nil && n > 2 {
				unix.CloseOnExec(n)
			}
		}
	}
	for _, cmd := range cmds {
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		cmd.Stdin, cmd.Stderr = f, f
		if cmd.Stdout == nil {
			cmd.Stdout = f
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	}
	self, err := isolation.ProcOf(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if before != nil {
		before()
	}
	tr := ptrace.NewTracer()
	defer tr.Close()
	// Real freezer cgroups: the zygotes freeze there, and Kill ends them.
	cgroups := filepath.Join(freezer.Root, fmt.Sprintf("cairn-test-%s-%d", strings.ReplaceAll(t.Name(), "/", "-"), os.Getpid()))
	t.Cleanup(func() {
		ents, _ := os.ReadDir(cgroups) // none if the capture made none
		for _, e := range ents {
			if !e.IsDir() {
				continue
			}
			// The zygotes are our children here (CLONE_PARENT): reaped by us, not init.
			dir := filepath.Join(cgroups, e.Name())
			pids := freezer.Procs(dir)
			for _, pid := range pids {
				unix.Kill(pid, unix.SIGKILL)
			}
			freezer.Write(dir, freezer.Thawed)
			for _, pid := range pids {
				unix.Wait4(pid, nil, 0, nil)
			}
			KillCgroup(dir)
		}
		os.Remove(cgroups)
	})
	return Capture(context.Background(), tr, CaptureOptions{
		Init: self,
		Procs: func() ([]int, error) {
			var pids []int
			for _, cmd := range cmds {
				if st := ptrace.ProcState(cmd.Process.Pid); st != "gone" && st != "Z" {
					pids = append(pids, cmd.Process.Pid)
				}
			}
			return pids, nil
		},
		CgroupDir: cgroups,
		RecordDir: dir,
		Frozen: func() error {
			if frozen != nil {
				frozen()
			}
			return nil
		},
		Phase: phase,
	})
}

// TestCaptureGoneAtSeize: a process that passed the checks and is gone when the
// capture seizes it (a shell and its child killed together, conformance ResidentPaths)
// makes the capture try again, and the processes seized before it must be let go
// first. They were handed to the tracer to detach "once they stop", though they had
// been interrupted, and sat in a ptrace stop until its next tick: the next attempt
// found one stopped and gave up the zygotes (CRIU instead, 1 CI run).
func TestCaptureGoneAtSeize(t *testing.T) {
	live, dying := exec.Command("sleep", "1000"), exec.Command("sleep", "1000")
	killed := false
	rec, err := captureCmds(t, []*exec.Cmd{live, dying}, nil, nil, func(name string, _ time.Duration) {
		// Between the checks and the seizes, once: the second process ends and is reaped.
		if name == "check" && !killed {
			killed = true
			dying.Process.Kill()
			dying.Wait()
		}
	})
	if !killed {
		t.Fatal("the capture reported no check phase")
	}
	if live.Process.Pid > dying.Process.Pid {
		t.Skipf("the PIDs wrapped (%d > %d): the live process is not seized first", live.Process.Pid, dying.Process.Pid)
	}
	if err != nil {
		t.Fatalf("Capture: %v; want the live process captured on the next attempt", err)
	}
	if len(rec.Procs) != 1 {
		t.Fatalf("Capture recorded %d processes, want 1 (the live one)", len(rec.Procs))
	}
	if st := ptrace.ProcState(live.Process.Pid); st != "S" {
		t.Fatalf("after the capture the live process is in state %s, want S (sleeping, not stopped)", st)
	}
}

// TestSignalsDuringCapture: the signals that reach a process while it is stopped for a
// capture are all delivered once it runs again, the handlers of a Python process
// blocked in pause(2) included (ptrace.TestSignalsWhileStopped).
func TestSignalsDuringCapture(t *testing.T) {
	out := filepath.Join(t.TempDir(), "got")
	o, err := os.Create(out)
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	cmd := exec.Command("python3", "-c", `
import signal
got = []
def h(n, f):
    got.append(n)
    if len(got) == 2:
        print(sorted(got), flush=True)
signal.signal(signal.SIGUSR1, h)
signal.signal(signal.SIGUSR2, h)
print("ready", flush=True)
while True:
    signal.pause()
`)
	cmd.Stdout = o
	read := func() string { b, _ := os.ReadFile(out); return string(b) }
	wait := func(what string) bool {
		for i := 0; i < 500 && !strings.Contains(read(), what); i++ {
			time.Sleep(10 * time.Millisecond)
		}
		return strings.Contains(read(), what)
	}
	var pid int
	rec, err := captureCmd(t, cmd, func(child int) {
		pid = child
		if !wait("ready") {
			t.Fatalf("the process did not start: %q", read())
		}
	}, func(child int) {
		unix.Kill(child, unix.SIGUSR2)
		unix.Kill(child, unix.SIGUSR1)
	})
	// The signals reach the process as the capture scans it (refused then: it has
	// signals pending), or while calls are injected or its zygote made: either way
	// they are delivered.
	var in *Ineligible
	switch {
	case errors.As(err, &in) && strings.Contains(in.Reason, "pending signals"):
		t.Logf("the capture was refused: %v", err)
	case err != nil:
		t.Fatal(err)
	case len(rec.Procs) != 1:
		t.Fatalf("recorded %d processes, want 1", len(rec.Procs))
	}
	if want := fmt.Sprintf("[%d, %d]", unix.SIGUSR1, unix.SIGUSR2); !wait(want) {
		st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		t.Fatalf("the process printed %q, want both signals handled (%s); its status:\n%s", read(), want, st)
	}
}
