package engine_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/internal/testenv"
	"github.com/cairn-sandbox/cairn/isolation/container/freezer"
)

// TestRecoverBusySandbox leaves a sandbox frozen, as a checkpoint that died after its
// freeze does, with its lock held by someone else when the next engine starts (a process
// the dead engine was starting holds it until its exec). The new engine must not thaw it
// behind the holder's back, and must thaw it once the lock is free: it used to skip it,
// and the sandbox stayed frozen until the engine after.
func TestRecoverBusySandbox(t *testing.T) {
	e := testenv.EngineWith(t, func(c *engine.Config) { c.Standbys, c.Residents = -1, -1 })
	ctx := context.Background()
	sb, r := newREPL(t, e, true)
	r.ask("x = 41")
	dir := freezer.Of(sb.Init.Pid)
	if err := freezer.Write(dir, freezer.Frozen); err != nil {
		t.Fatal(err)
	}
	thawed := false
	defer func() {
		if !thawed {
			freezer.Write(dir, freezer.Thawed) // for the sandbox's removal
		}
	}()
	lock, err := os.OpenFile(filepath.Join(testenv.DataDir(), "locks", sb.ID), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	e2, err := engine.Open(ctx, testenv.Config(t))
	if err != nil {
		t.Fatal(err)
	}
	defer e2.Close()
	time.Sleep(200 * time.Millisecond)
	if got := freezer.State(dir); got != freezer.Frozen {
		t.Fatalf("with its lock held by another, the sandbox was thawed (%s) behind the holder's back", got)
	}
	unix.Flock(int(lock.Fd()), unix.LOCK_UN)
	for deadline := time.Now().Add(10 * time.Second); freezer.State(dir) != freezer.Thawed; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the sandbox is still %s 10 s after its lock was released", freezer.State(dir))
		}
	}
	thawed = true
	if got := r.ask("print(x + 1)"); got != "42" {
		t.Fatalf("REPL after the recovery: %q, want 42", got)
	}
}

// orphanCrashEnv names, in a TestRecoverOrphanTrees child, the checkpoint to fork or to
// prepare a standby of ("fork:ID" or "standby:ID"); CAIRN_TEST_CRASH_AT says where the
// child dies.
const orphanCrashEnv = "CAIRN_TEST_ORPHAN"

// TestRecoverOrphanTrees kills cairn once a fork, or a standby, is restored and before
// its row is written: its tree runs (a fork) or waits frozen (a standby) on a root no
// record names. Recovery must end the tree with the root; it used to delete the root
// only, and the processes ran or stayed frozen for good, holding their memory.
func TestRecoverOrphanTrees(t *testing.T) {
	if v := os.Getenv(orphanCrashEnv); v != "" {
		orphanCrashChild(t, v)
		return
	}
	e := testenv.EngineWith(t, func(c *engine.Config) { c.Standbys, c.Residents = -1, -1 })
	ctx := context.Background()
	sb, r := newREPL(t, e, true)
	r.ask("x = 7")
	ck, err := e.Checkpoint(ctx, sb.ID, engine.CheckpointOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ what, point string }{{"fork", "fork-restored"}, {"standby", "standby-restored"}} {
		t.Run(tc.what, func(t *testing.T) {
			before := cairnCgroups(t)
			cmd := exec.Command(os.Args[0], "-test.run=^TestRecoverOrphanTrees$", "-test.v")
			cmd.Env = append(os.Environ(), orphanCrashEnv+"="+tc.what+":"+ck.ID, "CAIRN_TEST_CRASH_AT="+tc.point)
			out, err := cmd.CombinedOutput()
			if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != -1 {
				t.Fatalf("crash child at %s did not die by signal: %v: %s", tc.point, err, out)
			}
			var orphans []string
			for cg := range cairnCgroups(t) {
				if !before[cg] {
					orphans = append(orphans, cg)
				}
			}
			if len(orphans) != 1 || len(cgroupTasks(orphans[0])) == 0 {
				t.Fatalf("new cgroups with tasks after the crash: %v; want the orphan tree's", orphans)
			}
			e2, err := engine.Open(ctx, testenv.Config(t))
			if err != nil {
				t.Fatal(err)
			}
			defer e2.Close()
			if tasks := cgroupTasks(orphans[0]); len(tasks) > 0 {
				t.Fatalf("after recovery the orphan %s still runs processes %v", orphans[0], tasks)
			}
		})
	}
}

// orphanCrashChild forks a checkpoint, or prepares a standby of it (Prewarm), in an
// engine of its own, which dies at CAIRN_TEST_CRASH_AT.
func orphanCrashChild(t *testing.T, v string) {
	what, id, _ := strings.Cut(v, ":")
	cfg := testenv.Config(t)
	cfg.Standbys, cfg.Residents = -1, -1
	if what == "standby" {
		cfg.Standbys = 1 // Prewarm needs them on; Open prepares none
	}
	e, err := engine.Open(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	switch what {
	case "fork":
		_, err = e.Fork(context.Background(), id, 1)
	case "standby":
		err = e.Prewarm(context.Background(), id, 1)
	}
	t.Fatalf("%s of %s returned (%v) instead of dying at %s", what, id, err, os.Getenv("CAIRN_TEST_CRASH_AT"))
}

// cairnCgroups lists the sandboxes' freezer cgroups (cairn/<name>).
func cairnCgroups(t *testing.T) map[string]bool {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join(freezer.Root, "cairn"))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, d := range ents {
		if d.IsDir() {
			out[d.Name()] = true
		}
	}
	return out
}

// cgroupTasks lists the tasks of the sandbox freezer cgroup cairn/<name> (none if gone).
func cgroupTasks(name string) []int { return freezer.Tasks(filepath.Join(freezer.Root, "cairn", name)) }
