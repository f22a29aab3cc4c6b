package conformance

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/internal/phase"
)

// Resident checkpoints (zygotes): which sandboxes get them, what inspect says about
// the others, and that a sandbox moves between the two paths without losing a
// checkpoint. Only where the engine keeps checkpoints resident (Harness.Resident).

// methodOf returns a checkpoint as inspect shows it.
func methodOf(t *testing.T, h Harness, ck string) *model.Checkpoint {
	t.Helper()
	c, err := h.Engine.GetCheckpoint(context.Background(), ck)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func wantResident(t *testing.T, h Harness, ck string) {
	t.Helper()
	c := methodOf(t, h, ck)
	if !strings.HasPrefix(c.Method, "zygote") || !c.Resident || !strings.Contains(c.MethodReason, "zygotes") {
		t.Fatalf("checkpoint %s: method %q, resident %v, reason %q; want a resident zygote checkpoint", ck, c.Method, c.Resident, c.MethodReason)
	}
}

func wantDumped(t *testing.T, h Harness, ck, because string) {
	t.Helper()
	c := methodOf(t, h, ck)
	if !strings.HasPrefix(c.Method, "criu") || !strings.Contains(c.MethodReason, because) {
		t.Fatalf("checkpoint %s: method %q, reason %q; want a CRIU dump because of %q", ck, c.Method, c.MethodReason, because)
	}
}

func testResidentPaths(t *testing.T, h Harness) {
	requireResident(t, h)
	ctx := context.Background()
	id, p := replSandbox(t, h)
	ask(t, h, id, p, "import threading, socket; x = 1")
	resident := checkpoint(t, h, id, "resident")
	wantResident(t, h, resident)

	// Ineligible processes, one at a time: the checkpoint is a CRIU dump and says why,
	// and once the process is gone the next one is resident again.
	cases := []struct {
		name, start, stop, because string
	}{
		{"thread blocked in a futex", "ev = threading.Event(); th = threading.Thread(target=ev.wait); th.start()", "ev.set(); th.join()", "threads"},
		{"listening socket", "ls = socket.socket(); ls.bind(('127.0.0.1', 0)); ls.listen()", "ls.close()", "socket"},
	}
	for _, c := range cases {
		ask(t, h, id, p, c.start)
		dumped := checkpoint(t, h, id, c.name)
		wantDumped(t, h, dumped, c.because)
		ask(t, h, id, p, c.stop+"; x += 1")
		again := checkpoint(t, h, id, "after "+c.name)
		wantResident(t, h, again)
		// Rolling back to the dumped checkpoint gives the ineligible state back...
		rollback(t, h, id, dumped)
		want(t, c.name+" after rollback", ask(t, h, id, p, c.stop+"; print('ok')"), "ok")
	}
	// ... and the first, resident checkpoint, whose zygotes the CRIU dumps ended, is
	// restored from its durable copy.
	if methodOf(t, h, resident).Resident {
		t.Fatalf("checkpoint %s is still resident after CRIU dumps of its sandbox", resident)
	}
	rollback(t, h, id, resident)
	want(t, "REPL at the first checkpoint", ask(t, h, id, p, "print(x)"), "1")
	again := checkpoint(t, h, id, "resident again")
	wantResident(t, h, again)

	// A process tree: a child of a child of init.
	tree := spawn(t, h, id, "sh", "-c", "sleep 1000 & wait")
	waitRunning(t, h, id, "sleep")
	wantDumped(t, h, checkpoint(t, h, id, "tree"), "not a child of init")
	h.Engine.Signal(ctx, id, tree, 9)
	// Until it has exited, a checkpoint may see it end while it stops the processes,
	// and dump them instead.
	waitExited(t, h, id, tree)

	// Durable on request: the checkpoint returns with its images written.
	ck, err := h.Engine.Checkpoint(ctx, id, engine.CheckpointOptions{Label: "durable", Durable: true})
	if err != nil {
		t.Fatal(err)
	}
	if ck.Method != "zygote-criu" {
		got, _ := h.Engine.GetCheckpoint(ctx, ck.ID)
		diag := ""
		if h.Diagnose != nil {
			diag = h.Diagnose(id)
		}
		t.Fatalf("durable checkpoint: method %q, want zygote-criu (%+v); the sandbox's processes now: %s", ck.Method, got, diag)
	}
}

// waitExited waits until the process p of the sandbox has exited.
func waitExited(t *testing.T, h Harness, id, p string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if pr, err := h.Engine.Process(context.Background(), id, p); err == nil && !pr.Running {
			return
		}
	}
	t.Fatalf("process %s of sandbox %s did not exit", p, id)
}

// waitRunning waits until a process whose command contains name runs in the sandbox.
func waitRunning(t *testing.T, h Harness, id, name string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if strings.Contains(sh(t, h, id, "ps -eo args"), name) {
			return
		}
	}
	t.Fatalf("no %s process in sandbox %s", name, id)
}

// recovered opens the next engine after a crash at point, closed when the test ends,
// and checks that its recovery left nothing behind.
func recovered(t *testing.T, h Harness, point string) *engine.Engine {
	t.Helper()
	e2, err := h.Reopen()
	if err != nil {
		t.Fatalf("reopen after crash: %v", err)
	}
	t.Cleanup(func() { e2.Close() })
	if leftovers := e2.Leftovers(); len(leftovers) > 0 {
		t.Fatalf("leftovers after recovery from a crash at %s: %v", point, leftovers)
	}
	return e2
}

// testCrashRollback kills cairn in the middle of a rollback through zygotes (the
// processes killed, the root being reverted; the processes forked again, not yet fixed
// up; forked and recorded, not yet committed): the next engine finds the sandbox by its
// mark and rolls it back again, from the same zygotes.
func testCrashRollback(t *testing.T, h Harness) {
	if !h.Resident || h.Crash == nil {
		t.Skip("the engine keeps no checkpoint resident")
	}
	ctx := context.Background()
	id, p := replSandbox(t, h)
	ask(t, h, id, p, "x = 1")
	sh(t, h, id, "echo one > /file")
	good := checkpoint(t, h, id, "good")
	// zygote-spawn-forked: the zygotes thawed, parked, and the processes forked from them
	// parked too, not yet released; the next rollback must settle them.
	for _, point := range []string{"resident-rollback-killed", "zygote-spawn-forked", "resident-rollback-spawned"} {
		t.Run(point, func(t *testing.T) {
			ask(t, h, id, p, "x = 2")
			sh(t, h, id, "echo two > /file")
			h.Crash(t, id, point+":"+good)
			e2 := recovered(t, h, point)
			sb, err := e2.Get(ctx, id)
			if err != nil || sb.State != model.StateRunning || sb.Head != good {
				t.Fatalf("sandbox after crash: %+v %v (want running, head %s)", sb, err, good)
			}
			want(t, "REPL after crash", ask(t, h, id, p, "print(x)"), "1")
			want(t, "file after crash", sh(t, h, id, "cat /file"), "one\n")
			// Rolled back again from its zygotes, which a crash leaves usable: the
			// checkpoint is still resident (a restore of images would have ended them).
			wantResident(t, h, good)
		})
	}
}

// testCrashRewind kills cairn in the middle of a rewind in place (Harness.Rewinds):
// with the processes stopped and parked and the root's revert running beside
// (rewind-begun), with their memory brought back but not their descriptors
// (rewind-copied), and with everything brought back but the processes still held
// (rewind-fixed). The crash child checkpoints and rolls back with its own engine, as a
// rewind needs the writes tracked by the engine that rolls back (crashRewind). The next
// engine finds the rollback's mark, kills the parked processes and forks them from the
// checkpoint's zygotes: one REPL, in the checkpoint's state, and the checkpoint's file.
func testCrashRewind(t *testing.T, h Harness) {
	if !h.Rewinds || h.Crash == nil {
		t.Skip("this backend (or kernel) does not rewind processes in place")
	}
	ctx := context.Background()
	id, p := replSandbox(t, h)
	for i, point := range []string{"rewind-begun", "rewind-copied", "rewind-fixed"} {
		t.Run(point, func(t *testing.T) {
			x := strconv.Itoa(10 + i)
			ask(t, h, id, p, "x = "+x)
			sh(t, h, id, "echo two > /file")
			h.Crash(t, id, point+":rewind:"+p)
			e2 := recovered(t, h, point) // closed before the next crash child: it tracks
			sb, err := e2.Get(ctx, id)
			if err != nil || sb.State != model.StateRunning {
				t.Fatalf("sandbox after crash: %+v %v (want running)", sb, err)
			}
			head, err := e2.GetCheckpoint(ctx, sb.Head)
			if err != nil || head.Label != "rewind-target" {
				t.Fatalf("head after crash: %+v %v (want the child's checkpoint rewind-target)", head, err)
			}
			want(t, "REPL after crash", ask(t, h, id, p, "print(x)"), x)
			want(t, "file after crash", sh(t, h, id, "cat /file"), "two\n")
			// One REPL (the zygotes are not readable): the parked one was ended, not
			// left beside its fork.
			if _, out, _ := run(t, h, id, "python3", "-c", sealedProbe); strings.Count(out, " readable") != 1 {
				t.Fatalf("REPLs after crash (pid readable|denied, denied are zygotes):\n%s", out)
			}
			// The recovered engine rewinds it again once a checkpoint of its own tracks
			// it (and stops tracking it when closed, for the next crash child).
			h2 := h
			h2.Engine = e2
			again := checkpoint(t, h2, id, "again")
			ask(t, h2, id, p, "x = -1")
			path := rollbackPath(t, h2, id, again)
			want(t, "REPL after a rollback", ask(t, h2, id, p, "print(x)"), x)
			if path != "rewound" {
				t.Fatalf("rollback after recovery took the path %q, want rewound", path)
			}
		})
	}
}

// sealedProbe lists, from inside a sandbox, every other python3 REPL process and
// whether its memory map can be read: "<pid> readable" or "<pid> denied".
const sealedProbe = `
import os
for pid in sorted(os.listdir("/proc")):
    if not pid.isdigit() or int(pid) in (1, os.getpid()):
        continue
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        continue
    if cmd[:2] != [b"python3", b"-i"]:
        continue
    try:
        open(f"/proc/{pid}/maps").read()
        print(pid, "readable")
    except OSError:
        print(pid, "denied")
`

// testZygotesSealed: a zygote holds the sandbox's state at its checkpoint, which a
// rollback to another branch must not reveal to the sandbox; its processes (no
// CAP_SYS_PTRACE) cannot read a zygote's memory or its /proc entries, since zygotes are
// not dumpable, while the processes forked from a zygote are as dumpable as the
// originals were.
func testZygotesSealed(t *testing.T, h Harness) {
	requireResident(t, h)
	id, p := replSandbox(t, h)
	ask(t, h, id, p, "x = 1")
	ck := checkpoint(t, h, id, "sealed")
	wantResident(t, h, ck)
	probe := func(when string) {
		t.Helper()
		_, out, _ := run(t, h, id, "python3", "-c", sealedProbe)
		readable, denied := 0, 0
		for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
			switch {
			case strings.HasSuffix(l, " readable"):
				readable++
			case strings.HasSuffix(l, " denied"):
				denied++
			}
		}
		if readable != 1 || denied < 1 {
			t.Fatalf("%s: the REPL's processes seen from inside:\n%s\nwant the REPL itself readable and its zygote(s) denied", when, out)
		}
	}
	probe("after the checkpoint")
	ask(t, h, id, p, "x = 2")
	rollback(t, h, id, ck)
	want(t, "REPL after rollback", ask(t, h, id, p, "print(x)"), "1")
	probe("after a rollback through the zygote")
}

// rollbackPath rolls sandbox id back to ck as rollback does and says how the backend
// brought the processes back: "rewound" in place, "refused" (a rewind was tried, and
// they were forked from the zygotes instead), "failed" (a rewind began and failed: they
// were killed and forked), or "" (no rewind was tried).
func rollbackPath(t *testing.T, h Harness, id, ck string) string {
	t.Helper()
	var mu sync.Mutex
	seen := map[string]bool{}
	ctx := phase.With(context.Background(), func(name string, _ time.Duration) {
		mu.Lock()
		seen[name] = true
		mu.Unlock()
	})
	if err := h.Engine.Rollback(ctx, id, ck); err != nil {
		t.Fatalf("rollback to %s: %v", ck, err)
	}
	h.settle()
	mu.Lock()
	defer mu.Unlock()
	switch {
	case seen["rewound"]:
		return "rewound"
	case seen["rewind_refused"]:
		return "refused"
	case seen["rewind_failed"]:
		return "failed"
	}
	return ""
}

// testRewind checks rollbacks in place (Harness.Rewinds): a REPL whose memory grew,
// shrank and moved (a large buffer mapped and unmapped, the heap trimmed, objects
// freed), that read on from a file and changed a float, is brought back to either of two
// checkpoints, in both directions, without being forked; one with a thread is not
// rewound (it is forked from its zygote, still right); once a checkpoint of its new
// process is taken, that one rewinds again; one that wrote more than a rewind copies
// back is forked.
func testRewind(t *testing.T, h Harness) {
	if !h.Rewinds {
		t.Skip("this backend (or kernel) does not rewind processes in place")
	}
	id := sandbox(t, h)
	sh(t, h, id, "printf 0123456789abcdefghij > /workspace/data")
	p := spawn(t, h, id, "python3", "-i", "-u")
	ask(t, h, id, p, `f = open("/workspace/data"); f.read(3); a = bytearray(16 << 20); a[5] = 1; keep = [bytes([i % 256]) * 4096 for i in range(200)]; x = 1.25`)
	ck1 := checkpoint(t, h, id, "one")
	ask(t, h, id, p, `a[5] = 9; del keep[::2]; b = bytearray(b"z" * (1 << 20)); f.read(4); x = x * 3`)
	ck2 := checkpoint(t, h, id, "two")
	ask(t, h, id, p, `del b; c = [str(i) * 10 for i in range(5000)]; a[5] = 42; f.read()`)
	state := `print(a[5], len(keep), sum(len(k) for k in keep), "b" in dir() and len(b), "c" in dir(), f.tell(), x)`
	at1, at2 := "1 200 819200 False False 3 1.25", "9 100 409600 1048576 False 7 3.75"
	want(t, "path of the rollback to one", rollbackPath(t, h, id, ck1), "rewound")
	want(t, "state after the rollback to one", ask(t, h, id, p, state), at1)
	want(t, "path of the rollback to two", rollbackPath(t, h, id, ck2), "rewound")
	want(t, "state after the rollback to two", ask(t, h, id, p, state), at2)
	ask(t, h, id, p, `a[5] = 50; b[0] = 0; keep.clear()`)
	want(t, "path of the rollback to one again", rollbackPath(t, h, id, ck1), "rewound")
	want(t, "state after the rollback to one again", ask(t, h, id, p, state), at1)
	ask(t, h, id, p, `import threading, time; th = threading.Thread(target=time.sleep, args=(1000,), daemon=True); th.start()`)
	want(t, "path of a rollback of a process with a thread", rollbackPath(t, h, id, ck2), "refused")
	want(t, "state after the rollback by fork", ask(t, h, id, p, state), at2)
	ck3 := checkpoint(t, h, id, "three")
	ask(t, h, id, p, `a[5] = 77; f.seek(0)`)
	want(t, "path of the rollback of the forked process", rollbackPath(t, h, id, ck3), "rewound")
	want(t, "state after it", ask(t, h, id, p, state), at2)
	// Too much to bring back (all of a, 16 MiB): forked instead, which shares the
	// zygote's pages rather than copying them.
	ask(t, h, id, p, `a[:] = b"q" * len(a)`)
	want(t, "path of a rollback with 16 MiB written", rollbackPath(t, h, id, ck3), "refused")
	want(t, "state after it", ask(t, h, id, p, state), at2)
}

// testPidHeld rolls back to a resident checkpoint while one of its processes' PIDs is
// held for a moment by a process outside the sandbox's tree (as a CRIU running in the
// sandbox's pid namespace holds one): the rollback must wait for it rather than fork a
// copy under another PID, which, killed while init is frozen, would hold that PID in
// turn, the next process's. The checkpoint's two processes have adjacent PIDs.
func testPidHeld(t *testing.T, h Harness) {
	requireResident(t, h)
	ctx := context.Background()
	id := sandbox(t, h)
	sb, err := h.Engine.Get(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	// inNS runs a shell in the sandbox's pid namespace (and the host's other
	// namespaces), where ns_last_pid can be written.
	inNS := func(script string) *exec.Cmd {
		return exec.Command("nsenter", "--target", strconv.Itoa(sb.Init.Pid), "--pid", "--", "bash", "-c", script)
	}
	setNext := func(pid int) {
		t.Helper()
		if out, err := inNS(fmt.Sprintf("echo %d > /proc/sys/kernel/ns_last_pid", pid-1)).CombinedOutput(); err != nil {
			t.Fatalf("set the sandbox's next PID: %v: %s", err, out)
		}
	}
	// Init's runtime may start a thread between the two execs, taking a PID: try a few
	// bases until the two sleeps are neighbours.
	base := 0
	for try := 0; try < 5 && base == 0; try++ {
		b := 5000 + 1000*try
		setNext(b)
		spawn(t, h, id, "sleep", "1000")
		spawn(t, h, id, "sleep", "1000")
		if got := sh(t, h, id, "pgrep -x sleep | sort -n | tr '\\n' ' '"); got == fmt.Sprintf("%d %d ", b, b+1) {
			base = b
		} else {
			sh(t, h, id, "pkill -x sleep; while pgrep -x sleep >/dev/null; do sleep 0.01; done")
		}
	}
	if base == 0 {
		t.Fatal("could not start two processes with neighbouring PIDs in 5 tries")
	}
	ck := checkpoint(t, h, id, "neighbours")
	wantResident(t, h, ck)
	// By PID: the zygotes, copies of the sleeps, are sleeps of the namespace too.
	sh(t, h, id, fmt.Sprintf("kill %d %d; while kill -0 %d || kill -0 %d; do sleep 0.01; done 2>/dev/null", base, base+1, base, base+1))
	// The holder takes the first sleep's PID for 300 ms; its parent, outside the
	// sandbox's cgroups, reaps it.
	holder := inNS(fmt.Sprintf("echo %d > /proc/sys/kernel/ns_last_pid; sleep 0.3 & echo $!; wait", base-1))
	out, err := holder.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := holder.Start(); err != nil {
		t.Fatalf("start the PID holder: %v", err)
	}
	defer holder.Wait()
	line := make([]byte, 16)
	n, _ := out.Read(line)
	if got := strings.TrimSpace(string(line[:n])); got != strconv.Itoa(base) {
		t.Fatalf("the holder got PID %q in the sandbox, want %d", got, base)
	}
	rollback(t, h, id, ck)
	if got := sh(t, h, id, fmt.Sprintf("cat /proc/%d/comm /proc/%d/comm", base, base+1)); got != "sleep\nsleep\n" {
		t.Fatalf("after the rollback PIDs %d and %d are %q, want two sleeps", base, base+1, got)
	}
}

// testSpawnFails fails the spawn of a rollback to a resident checkpoint once its
// processes are forked (CAIRN_TEST_FAIL_AT): the rollback must still succeed, from the
// checkpoint's images restored into the sandbox's running init (the same generation),
// and keep the sandbox's other checkpoints resident, rather than start a new init,
// which would first make every resident checkpoint durable.
func testSpawnFails(t *testing.T, h Harness) {
	requireResident(t, h)
	ctx := context.Background()
	id, p := replSandbox(t, h)
	ask(t, h, id, p, "x = 1")
	target := checkpoint(t, h, id, "x1")
	ask(t, h, id, p, "x = 2")
	other := checkpoint(t, h, id, "x2")
	wantResident(t, h, target)
	wantResident(t, h, other)
	// A descriptor opened since makes the rollback kill and fork (no rewind in place).
	ask(t, h, id, p, "x = 3; f = open('/etc/hostname')")
	before, err := h.Engine.Get(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	stats := h.Engine.Stats()
	t.Setenv("CAIRN_TEST_FAIL_AT", "zygote-spawn-forked")
	if err := h.Engine.Rollback(ctx, id, target); err != nil {
		t.Fatalf("rollback whose spawn fails: %v", err)
	}
	os.Unsetenv("CAIRN_TEST_FAIL_AT")
	h.settle()
	want(t, "x after the rollback", ask(t, h, id, p, "print(x)"), "1")
	after, err := h.Engine.Get(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if after.Init != before.Init {
		t.Fatalf("the rollback started a new init (%+v, was %+v): it should restore the images into the running one", after.Init, before.Init)
	}
	if got := h.Engine.Stats().InPlaceRestores; got != stats.InPlaceRestores+1 {
		t.Fatalf("in-place restores %d, want %d", got, stats.InPlaceRestores+1)
	}
	if !methodOf(t, h, other).Resident {
		t.Fatalf("checkpoint %s lost its zygotes in the fallback", other)
	}
	// And the other checkpoint is still rolled back to through its zygotes.
	rollback(t, h, id, other)
	want(t, "x after the rollback to the other", ask(t, h, id, p, "print(x)"), "2")
}

// requireResident skips a test of resident checkpoints under a harness whose engine
// keeps none (no standby, warm pools: every checkpoint is a CRIU dump).
func requireResident(t *testing.T, h Harness) {
	t.Helper()
	if !h.Resident {
		t.Skip("the engine keeps no checkpoint resident")
	}
}
