package conformance

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/errdefs"
)

// The hazards of restoring a process tree from a copy rather than from its own past:
// shared file offsets, pipe buffers, children born after the checkpoint, and leaks over
// many rollbacks.

func testFileOffset(t *testing.T, h Harness) {
	id := sandbox(t, h)
	sh(t, h, id, "printf 0123456789abcdefghij > /workspace/data")
	p := spawn(t, h, id, "python3", "-i", "-u")
	ask(t, h, id, p, `f = open("/workspace/data"); f.read(5)`)
	ck := checkpoint(t, h, id, "offset-5")
	want(t, "read after checkpoint", ask(t, h, id, p, `print(f.read(10))`), "56789abcde")
	rollback(t, h, id, ck)
	want(t, "offset after rollback", ask(t, h, id, p, `print(f.tell(), f.read(3))`), "5 567")
}

func testPipeBuffer(t *testing.T, h Harness) {
	id, p := replSandbox(t, h)
	ask(t, h, id, p, `import os; r, w = os.pipe(); os.write(w, b"unread")`)
	ck := checkpoint(t, h, id, "pipe-full")
	want(t, "drain after checkpoint", ask(t, h, id, p, `print(os.read(r, 100))`), "b'unread'")
	rollback(t, h, id, ck)
	want(t, "pipe after rollback", ask(t, h, id, p, `print(os.read(r, 100))`), "b'unread'")

	// The same pipe, both ends in one process, made durable: its images hold the pipe
	// once, with its data, and a rollback from them gives it back.
	ask(t, h, id, p, `os.write(w, b"imaged")`)
	durable, err := h.Engine.Checkpoint(context.Background(), id, engine.CheckpointOptions{Label: "pipe-durable", Durable: true})
	if err != nil {
		t.Fatalf("durable checkpoint of a pipe with unread data: %v", err)
	}
	h.settle()
	want(t, "drain after durable checkpoint", ask(t, h, id, p, `print(os.read(r, 100))`), "b'imaged'")
	if h.Resident {
		// A CRIU dump of the sandbox ends the zygotes: the rollback must use the images.
		ask(t, h, id, p, "import socket; ls = socket.socket(); ls.bind(('127.0.0.1', 0)); ls.listen()")
		wantDumped(t, h, checkpoint(t, h, id, "listening"), "socket")
		ask(t, h, id, p, "ls.close()")
		if methodOf(t, h, durable.ID).Resident {
			t.Fatalf("checkpoint %s is still resident after a CRIU dump of its sandbox", durable.ID)
		}
	}
	rollback(t, h, id, durable.ID)
	want(t, "pipe after rollback from images", ask(t, h, id, p, `print(os.read(r, 100))`), "b'imaged'")
}

func testLateChild(t *testing.T, h Harness) {
	ctx := context.Background()
	id, p := replSandbox(t, h)
	ask(t, h, id, p, `import subprocess`)
	ck := checkpoint(t, h, id, "no-children")
	late := spawn(t, h, id, "sleep", "1000")
	ask(t, h, id, p, `kid = subprocess.Popen(["sleep", "999"])`)
	want(t, "children before rollback", sh(t, h, id, "pgrep -c sleep"), "2\n")
	rollback(t, h, id, ck)
	want(t, "children after rollback", sh(t, h, id, "pgrep -c sleep || true"), "0\n")
	if _, err := h.Engine.Process(ctx, id, late); errdefs.Code(err) != "not_found" {
		t.Fatalf("process started after the checkpoint is still known after rollback: %v", err)
	}
	want(t, "REPL has no child", ask(t, h, id, p, `print("kid" in dir())`), "False")
}

// testManyRollbacks rolls back to one checkpoint Harness.Stress times and checks that
// nothing grows: the engine's descriptors and heap, the sandbox trees on the host, the
// pool's roots and the standby cache.
// sandboxFootprint counts the processes in the sandbox's pid namespace (zygotes
// included) and the anonymous memory its memory cgroup holds (zygotes' pages are
// charged there too).
func sandboxFootprint(t *testing.T, h Harness, id string) (procs int, rss int64) {
	t.Helper()
	if h.Isolation != "container" {
		return 0, 0 // gVisor's processes are the sentry's, not the host's
	}
	sb, err := h.Engine.Get(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	ns, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", sb.Init.Pid))
	dirs, _ := os.ReadDir("/proc")
	for _, d := range dirs {
		if l, err := os.Readlink("/proc/" + d.Name() + "/ns/pid"); err == nil && l == ns {
			procs++
		}
	}
	b, _ := os.ReadFile(filepath.Join("/sys/fs/cgroup/memory/cairn", filepath.Base(sb.Root), "memory.stat"))
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "total_rss "); ok {
			rss, _ = strconv.ParseInt(v, 10, 64)
		}
	}
	return procs, rss
}

func testManyRollbacks(t *testing.T, h Harness) {
	n := h.Stress
	if n == 0 {
		n = 50
	}
	ctx := context.Background()
	id, p := replSandbox(t, h)
	ask(t, h, id, p, "x = 7")
	ck := checkpoint(t, h, id, "base")
	measure := func() (fds, trees, roots int, heap uint64, procs int, rss int64) {
		h.Engine.Quiesce()
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		// Calls to init close their inotify instance in the background (an fsnotify
		// grace period, up to ~20 ms each): the fewest descriptors over 200 ms.
		fds = 1 << 30
		for i := 0; i < 10; i++ {
			ents, _ := os.ReadDir("/proc/self/fd")
			fds = min(fds, len(ents))
			time.Sleep(20 * time.Millisecond)
		}
		// Trees of this sandbox: its root generations' cgroups, and its standbys.
		gens, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup/freezer/cairn", id+"-*"))
		standbys, _ := h.Engine.StandbyCount(ctx, ck)
		pool, _ := filepath.Glob(filepath.Join(h.Engine.DataDir(), "pool", "roots", id+"-*"))
		procs, rss = sandboxFootprint(t, h, id)
		return fds, len(gens) + standbys, len(pool), ms.HeapAlloc, procs, rss
	}
	// Warm up so caches (SQLite's connections, the standby of ck) reach their steady state.
	for i := 0; i < 20; i++ {
		rollback(t, h, id, ck)
	}
	fds0, trees0, roots0, heap0, procs0, rss0 := measure()
	for i := 0; i < n; i++ {
		if err := h.Engine.Rollback(ctx, id, ck); err != nil {
			t.Fatalf("rollback %d: %v", i, err)
		}
		h.settle()
		if i%10 == 9 {
			ask(t, h, id, p, fmt.Sprintf("x += %d", i))
		}
	}
	rollback(t, h, id, ck)
	want(t, "state after many rollbacks", ask(t, h, id, p, "print(x)"), "7")
	fds1, trees1, roots1, heap1, procs1, rss1 := measure()
	// Bounds, not equalities: whether the last rollback took the standby path or the
	// restore path changes which root and cgroup the sandbox runs on, not their number.
	// Inside the sandbox: as many processes (its own, zygotes included) and as much
	// resident memory as after the warm-up.
	if fds1 > fds0+2 || trees1 > 3 || roots1 > 1 || heap1 > heap0+8<<20 || procs1 > procs0 || rss1 > rss0+16<<20 {
		t.Fatalf("growth over %d rollbacks: fds %d→%d, sandbox trees %d→%d, roots %d→%d, heap %d→%d, sandbox processes %d→%d, sandbox memory %d→%d",
			n, fds0, fds1, trees0, trees1, roots0, roots1, heap0, heap1, procs0, procs1, rss0, rss1)
	}
	ps, _ := h.Engine.Processes(ctx, id)
	running := 0
	for _, pr := range ps {
		if pr.Running {
			running++
		}
	}
	if running != 1 {
		t.Fatalf("%d processes running after rollbacks, want the REPL only: %+v", running, ps)
	}
}
