package engine_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cairn-sandbox/cairn/criu/incremental"
	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/internal/phase"
	"github.com/cairn-sandbox/cairn/internal/testenv"
)

// TestResidentImages takes a chain of resident checkpoints of a process holding 48 MiB
// that changes ~1 MiB per step, waits for their durable copies and compaction, and
// checks that each copy after the first is incremental against its parent's images of
// the same process and small; that, with the zygotes ended, every checkpoint is
// restored from its images (fork, rollback); and that deleting a checkpoint in the
// middle rebases its child's images, which stay restorable.
func TestResidentImages(t *testing.T) {
	// Images on the data directory's filesystem: chains of parent links (no image pool).
	e := testenv.EngineWith(t, func(c *engine.Config) { c.Standbys, c.ImagePool = -1, "none" })
	ctx := context.Background()
	sb, r := newREPL(t, e, true)
	state := func(r *repl) string { return r.ask(bufferState) }
	cks, states := bufferCheckpoints(t, e, sb.ID, r, 3)
	for k, ck := range cks {
		if ck.Method != "zygote" {
			t.Fatalf("checkpoint %d: method %s, want zygote (resident)", k+1, ck.Method)
		}
	}
	e.Quiesce()
	procsOf := func(ck *model.Checkpoint) string {
		dirs, _ := filepath.Glob(filepath.Join(e.DataDir(), ck.Images, "procs", "*"))
		if len(dirs) != 1 {
			t.Fatalf("checkpoint %s: per-process image directories %v, want one", ck.ID, dirs)
		}
		return dirs[0]
	}
	var sizes []int64
	for k, c := range cks {
		ck, err := e.GetCheckpoint(ctx, c.ID)
		if err != nil {
			t.Fatal(err)
		}
		if ck.Method != "zygote-criu" {
			t.Fatalf("checkpoint %d after its durable copy: method %s, want zygote-criu", k+1, ck.Method)
		}
		dir := procsOf(ck)
		link, err := incremental.Parent(dir)
		if err != nil {
			t.Fatal(err)
		}
		if want := k > 0; (link != "") != want {
			t.Fatalf("checkpoint %d: images linked to %q, want a parent link: %v", k+1, link, want)
		}
		if k > 0 && link != procsOf(cks[k-1]) {
			t.Fatalf("checkpoint %d: images linked to %s, want its parent's %s", k+1, link, procsOf(cks[k-1]))
		}
		sizes = append(sizes, engine.DirBytes(dir))
	}
	if sizes[1] > sizes[0]/4 || sizes[2] > sizes[0]/4 {
		t.Fatalf("per-process images %v bytes: the incremental ones should be a fraction of the first", sizes)
	}
	// Every fork restores images; the first fork of each is checked.
	for k, ck := range cks {
		kids, err := e.Fork(ctx, ck.ID, 1)
		if err != nil {
			t.Fatalf("fork of checkpoint %d: %v", k+1, err)
		}
		t.Cleanup(func() { e.Remove(context.Background(), kids[0].ID) })
		kr := &repl{t: t, e: e, sb: kids[0].ID, p: r.p}
		if got := state(kr); got != states[k] {
			t.Fatalf("fork of checkpoint %d: %s, want %s", k+1, got, states[k])
		}
	}
	// The middle checkpoint goes: the last one's images are rebased onto the first's.
	if err := e.DeleteCheckpointsForTest(ctx, cks[1].ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(e.DataDir(), cks[1].Images)); !os.IsNotExist(err) {
		t.Fatalf("images of the deleted checkpoint are still there: %v", err)
	}
	if link, _ := incremental.Parent(procsOf(cks[2])); link != procsOf(cks[0]) {
		t.Fatalf("after the delete the last checkpoint's images link to %q, want %s", link, procsOf(cks[0]))
	}
	// Without zygotes (a CRIU dump of the sandbox would take them in: settle ends them),
	// a rollback restores the images.
	if err := e.Settle(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	for _, k := range []int{2, 0} {
		if err := e.Rollback(ctx, sb.ID, cks[k].ID); err != nil {
			t.Fatalf("rollback to checkpoint %d: %v", k+1, err)
		}
		if got := state(r); got != states[k] {
			t.Fatalf("rollback to checkpoint %d (images): %s, want %s", k+1, got, states[k])
		}
	}
	if got := e.Stats().ResidentRollbacks; got != 0 {
		t.Fatalf("%d rollbacks went through zygotes, after Settle ended them", got)
	}
}

// TestRollbackInPlace rolls a sandbox back to a checkpoint whose zygotes were evicted
// (Config.Residents = 1): its images are restored into the sandbox's running init,
// which keeps the other checkpoint resident, and a rollback to that one then goes
// through its zygotes. Files and REPL state are checked after each.
func TestRollbackInPlace(t *testing.T) {
	e := testenv.EngineWith(t, func(c *engine.Config) { c.Standbys, c.Residents = -1, 1 })
	ctx := context.Background()
	sb, r := newREPL(t, e, true)
	state := func() string {
		return r.ask("print(x, open('/f').read().strip())")
	}
	var cks []*model.Checkpoint
	for k := 1; k <= 2; k++ {
		r.ask(fmt.Sprintf("x = %d\nopen('/f', 'w').write('file %d')", k, k))
		ck, err := e.Checkpoint(ctx, sb.ID, engine.CheckpointOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cks = append(cks, ck)
	}
	e.Quiesce()
	first, err := e.GetCheckpoint(ctx, cks[0].ID)
	if err != nil {
		t.Fatal(err)
	}
	if first.Resident || first.Method != "zygote-criu" {
		t.Fatalf("first checkpoint: method %s, resident %v; want evicted after its durable copy", first.Method, first.Resident)
	}
	r.ask("x = 3\nopen('/f', 'w').write('file 3')")
	before, err := e.Get(ctx, sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Rollback(ctx, sb.ID, cks[0].ID); err != nil {
		t.Fatal(err)
	}
	if got := state(); got != "1 file 1" {
		t.Fatalf("after the rollback in place: %q, want %q", got, "1 file 1")
	}
	after, err := e.Get(ctx, sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if st := e.Stats(); st.InPlaceRestores != 1 || after.Init != before.Init || after.Root != before.Root {
		t.Fatalf("rollback to the evicted checkpoint: %d restores in place, init %v→%v, root %s→%s; want 1, the same init and root",
			st.InPlaceRestores, before.Init, after.Init, before.Root, after.Root)
	}
	second, err := e.GetCheckpoint(ctx, cks[1].ID)
	if err != nil {
		t.Fatal(err)
	}
	if !second.Resident {
		t.Fatalf("second checkpoint lost its zygotes in the rollback in place (method %s)", second.Method)
	}
	if err := e.Rollback(ctx, sb.ID, cks[1].ID); err != nil {
		t.Fatal(err)
	}
	if got := state(); got != "2 file 2" {
		t.Fatalf("after the rollback through zygotes: %q, want %q", got, "2 file 2")
	}
	if st := e.Stats(); st.ResidentRollbacks != 1 || st.Reverts != 2 || st.RevertOps == 0 || st.RevertSnapshotMS <= 0 {
		t.Fatalf("rollback to the resident checkpoint: %d through zygotes, %d reverts of %d operations (snapshots %.1f ms); want 1, 2 and some",
			st.ResidentRollbacks, st.Reverts, st.RevertOps, st.RevertSnapshotMS)
	}
}

// TestEvictionKeepsLineage checks which zygotes go when a sandbox holds more resident
// checkpoints than Config.Residents (2): with a (x=1) → b (x=2), a rollback to a and
// a → c (x=3), b is off the lineage of the head c and goes, although a is older; a
// rollback to a then forks its zygotes again.
func TestEvictionKeepsLineage(t *testing.T) {
	e := testenv.EngineWith(t, func(c *engine.Config) { c.Standbys, c.Residents = -1, 2 })
	ctx := context.Background()
	sb, r := newREPL(t, e, true)
	checkpoint := func(x int) *model.Checkpoint {
		t.Helper()
		r.ask(fmt.Sprintf("x = %d", x))
		ck, err := e.Checkpoint(ctx, sb.ID, engine.CheckpointOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return ck
	}
	a := checkpoint(1)
	b := checkpoint(2)
	if err := e.Rollback(ctx, sb.ID, a.ID); err != nil {
		t.Fatal(err)
	}
	c := checkpoint(3)
	e.Quiesce()
	for _, want := range []struct {
		ck       *model.Checkpoint
		resident bool
	}{{a, true}, {b, false}, {c, true}} {
		got, err := e.GetCheckpoint(ctx, want.ck.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got.Resident != want.resident || got.Method != "zygote-criu" {
			t.Fatalf("checkpoint %s (parent %s): resident %v, method %s; want resident %v after its durable copy (a %s, b %s, c %s)",
				got.ID, got.Parent, got.Resident, got.Method, want.resident, a.ID, b.ID, c.ID)
		}
	}
	before := e.Stats().ResidentRollbacks
	if err := e.Rollback(ctx, sb.ID, a.ID); err != nil {
		t.Fatal(err)
	}
	if got := r.ask("print(x)"); got != "1" {
		t.Fatalf("after the rollback to a: x = %q, want 1", got)
	}
	if got := e.Stats().ResidentRollbacks - before; got != 1 {
		t.Fatalf("rollback to a went through zygotes %d times, want 1", got)
	}
}

// TestResidentMemoryBound checks what the zygotes of a REPL rewriting a 32 MiB buffer
// between checkpoints hold, and that Config.ResidentMemory (80 MiB) bounds it: once
// the buffer is rewritten, each checkpoint's zygote alone keeps its version (~32 MiB:
// reported by GetCheckpoint, and summed by Inspect), so of three checkpoints the oldest
// loses its zygotes after its durable copy (three would hold ~96 MiB). Rollbacks to
// each then find its state (the first's restored from its images).
func TestResidentMemoryBound(t *testing.T) {
	const mib = 1 << 20
	e := testenv.EngineWith(t, func(c *engine.Config) { c.Standbys, c.ResidentMemory = -1, 80*mib })
	ctx := context.Background()
	sb, r := newREPL(t, e, true)
	r.ask("b = bytearray(32 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1")
	var cks []*model.Checkpoint
	for k := 1; k <= 3; k++ {
		// Every page of the buffer written anew: the last checkpoint's zygote keeps the old.
		r.ask(fmt.Sprintf("step = %d\nfor i in range(0, len(b), 4096): b[i] = %d", k, k+1))
		ck, err := e.Checkpoint(ctx, sb.ID, engine.CheckpointOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cks = append(cks, ck)
		r.ask("for i in range(0, len(b), 4096): b[i] = 100")
		e.Quiesce()
	}
	got := func(ck *model.Checkpoint) *model.Checkpoint {
		t.Helper()
		c, err := e.GetCheckpoint(ctx, ck.ID)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	if c := got(cks[0]); c.Resident {
		t.Fatalf("first checkpoint still resident, its zygotes holding %d MiB; want evicted to keep within 80 MiB", c.ResidentMemoryBytes/mib)
	}
	for _, ck := range cks[1:] {
		c := got(ck)
		if !c.Resident || c.ResidentMemoryBytes < 30*mib || c.ResidentMemoryBytes > 40*mib {
			t.Fatalf("checkpoint %s: resident %v, its zygotes alone holding %.1f MiB; want resident, ~32 MiB (the buffer's pages written since)",
				c.ID, c.Resident, float64(c.ResidentMemoryBytes)/mib)
		}
	}
	s, err := e.Inspect(ctx, sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if s.ResidentMemoryBytes < 60*mib || s.ResidentMemoryBytes > 72*mib || s.ResidentCheckpoints != 2 {
		t.Fatalf("the sandbox's %d resident checkpoints hold %.1f MiB; want 2, ~64 MiB (two checkpoints' old buffers)",
			s.ResidentCheckpoints, float64(s.ResidentMemoryBytes)/mib)
	}
	if st := e.Stats(); st.ResidentsEvictedForMemory != 1 {
		t.Fatalf("%d resident checkpoints evicted for memory, want 1", st.ResidentsEvictedForMemory)
	}
	for k, ck := range cks {
		if err := e.Rollback(ctx, sb.ID, ck.ID); err != nil {
			t.Fatal(err)
		}
		if got := r.ask("print(step, b[0], b[len(b) - 4096])"); got != fmt.Sprintf("%d %d %d", k+1, k+2, k+2) {
			t.Fatalf("after the rollback to checkpoint %d: %q", k+1, got)
		}
	}
}

// inPlaceCrashEnv marks the child process of TestRollbackInPlaceCrash, and names its
// crash point.
const inPlaceCrashEnv = "CAIRN_IN_PLACE_CRASH"

// TestRollbackInPlaceCrash kills the engine (SIGKILL, in a child process) in the middle
// of a rollback in place by images: with its processes killed and its root not reverted
// (durable-rollback-killed), and with them stopped, before the kill, while the planned
// revert asks whether the root changed (rollback-quiesced: the rollback follows a
// checkpoint). The next engine finds the sandbox by its mark and rolls it back again,
// and the state is the checkpoint's.
func TestRollbackInPlaceCrash(t *testing.T) {
	if p := os.Getenv(inPlaceCrashEnv); p != "" {
		inPlaceCrashChild(t, p)
		return
	}
	for _, point := range []string{"durable-rollback-killed", "rollback-quiesced"} {
		t.Run(point, func(t *testing.T) { testRollbackInPlaceCrash(t, point) })
	}
}

func testRollbackInPlaceCrash(t *testing.T, point string) {
	ctx := context.Background()
	cmd := exec.Command(os.Args[0], "-test.run=^TestRollbackInPlaceCrash$", "-test.v")
	cmd.Env = append(os.Environ(), inPlaceCrashEnv+"="+point)
	out, err := cmd.CombinedOutput()
	got := childReport(string(out))
	cfg := testenv.Config(t)
	cfg.Standbys = -1
	e, err2 := engine.Open(ctx, cfg)
	if err2 != nil {
		t.Fatalf("reopen after crash: %v", err2)
	}
	t.Cleanup(func() { e.Close() })
	if sb := got["sandbox"]; sb != "" {
		t.Cleanup(func() { removeWithCheckpoints(e, sb) })
	}
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != -1 {
		t.Fatalf("crash child did not die by signal: %v: %s", err, out)
	}
	e.Quiesce()
	if l := e.Leftovers(); len(l) > 0 {
		t.Fatalf("leftovers after recovery: %v", l)
	}
	sb, err := e.Get(ctx, got["sandbox"])
	if err != nil || sb.State != model.StateRunning || sb.Head != got["target"] {
		t.Fatalf("sandbox after crash: %+v %v (want running, head %s)", sb, err, got["target"])
	}
	r := &repl{t: t, e: e, sb: sb.ID, p: got["process"]}
	if s := r.ask("print(x, open('/f').read().strip())"); s != "1 file 1" {
		t.Fatalf("after recovery: %q, want %q", s, "1 file 1")
	}
}

// inPlaceCrashChild takes two checkpoints with one resident at a time, so the first is
// evicted, and dies at point rolling back to it.
func inPlaceCrashChild(t *testing.T, point string) {
	e := testenv.EngineWith(t, func(c *engine.Config) { c.Standbys, c.Residents = -1, 1 })
	ctx := context.Background()
	sb, r := newREPL(t, e, false)
	fmt.Printf("crash-child sandbox %s\ncrash-child process %s\n", sb.ID, r.p)
	var cks []*model.Checkpoint
	for k := 1; k <= 2; k++ {
		r.ask(fmt.Sprintf("x = %d\nopen('/f', 'w').write('file %d')", k, k))
		ck, err := e.Checkpoint(ctx, sb.ID, engine.CheckpointOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cks = append(cks, ck)
	}
	e.Quiesce()
	if ck, err := e.GetCheckpoint(ctx, cks[0].ID); err != nil || ck.Resident {
		t.Fatalf("first checkpoint still resident (%v): nothing to roll back in place", err)
	}
	fmt.Printf("crash-child target %s\n", cks[0].ID)
	os.Setenv("CAIRN_TEST_CRASH_AT", point)
	// rollback-quiesced needs the root as the head checkpoint has it (a checkpoint just
	// taken) and no dirty data anywhere in the pool, which the tests of other packages,
	// sharing it, may be writing meanwhile: the revert is then not planned, the
	// rollback completes, and the child tries again.
	for try := 0; try < 20; try++ {
		r.ask("x = 3\nopen('/f', 'w').write('file 3')")
		if point == "rollback-quiesced" {
			if _, err := e.Checkpoint(ctx, sb.ID, engine.CheckpointOptions{Durable: true}); err != nil {
				t.Fatal(err)
			}
		}
		if err := e.Rollback(ctx, sb.ID, cks[0].ID); err != nil {
			t.Fatal(err)
		}
	}
	t.Fatalf("no crash at %s", point)
}

// TestRecoverLostCheckpoint: a checkpoint whose filesystem a crash of the machine took
// (its snapshot is published lazily) while its row survived is deleted by the next
// engine's recovery, once it is alone (not by an engine opened beside a live one); the
// sandbox's head goes back to its parent, which still rolls back.
func TestRecoverLostCheckpoint(t *testing.T) {
	e := testenv.Engine(t)
	ctx := context.Background()
	sb, r := newREPL(t, e, true)
	r.ask("x = 1")
	c1, err := e.Checkpoint(ctx, sb.ID, engine.CheckpointOptions{Durable: true})
	if err != nil {
		t.Fatal(err)
	}
	r.ask("x = 2")
	c2, err := e.Checkpoint(ctx, sb.ID, engine.CheckpointOptions{})
	if err != nil {
		t.Fatal(err)
	}
	e.Quiesce()
	// What the crash leaves: c2's row, not its filesystem; and no engine (the next one
	// is alone on the data directory, and recovers).
	if out, err := exec.Command("btrfs", "subvolume", "delete", e.PoolPath(c2.FSVolume)).CombinedOutput(); err != nil {
		t.Fatalf("delete %s: %v: %s", c2.FSVolume, err, out)
	}
	// An engine opened beside a live one leaves its checkpoints alone: a row before its
	// filesystem is what a split snapshot still being made looks like.
	beside, err := engine.Open(ctx, testenv.Config(t))
	if err != nil {
		t.Fatal(err)
	}
	_, err = beside.GetCheckpoint(ctx, c2.ID)
	beside.Close()
	if err != nil {
		t.Fatalf("an engine opened beside a live one deleted checkpoint %s: %v", c2.ID, err)
	}
	e.Close()
	e2, err := engine.Open(ctx, testenv.Config(t))
	if err != nil {
		t.Fatal(err)
	}
	defer e2.Close()
	defer e2.Quiesce()
	defer e2.Remove(ctx, sb.ID) // e, closed, cannot
	if _, err := e2.GetCheckpoint(ctx, c2.ID); err == nil {
		t.Fatalf("checkpoint %s, whose filesystem is gone, is still listed", c2.ID)
	}
	got, err := e2.Get(ctx, sb.ID)
	if err != nil || got.Head != c1.ID {
		t.Fatalf("sandbox after recovery: %+v, %v; want head %s", got, err, c1.ID)
	}
	if left := e2.Leftovers(); len(left) > 0 {
		t.Fatalf("leftovers after recovery: %v", left)
	}
	if err := e2.Rollback(ctx, sb.ID, c1.ID); err != nil {
		t.Fatal(err)
	}
	r.e = e2
	if got := r.ask("print(x)"); got != "1" {
		t.Fatalf("REPL after rollback to %s: %q, want 1", c1.ID, got)
	}
}

// TestRollbackReusedPID rolls back to a checkpoint one of whose processes has a PID that
// a process born later could have taken: with c (the REPL alone), then b (the REPL and a
// sleep beside it), a rollback to c kills the sleep, and the zygote of the next
// checkpoint is forked then. Had the namespace's next PID gone back to the REPL's (as
// the spawn of c's processes leaves it), that zygote would take the sleep's PID, which
// the rollback to b needs: its spawn would find the PID taken and fall back to images.
func TestRollbackReusedPID(t *testing.T) {
	e := testenv.EngineWith(t, func(c *engine.Config) { c.Standbys = -1 })
	ctx := context.Background()
	sb, r := newREPL(t, e, true)
	checkpoint := func() *model.Checkpoint { t.Helper(); return residentCheckpoint(t, e, sb.ID) }
	r.ask("import os")
	c := checkpoint()
	h, err := e.Exec(ctx, sb.ID, model.ExecOptions{Args: []string{"sleep", "1000"}, NoStdin: true})
	if err != nil {
		t.Fatal(err)
	}
	b := checkpoint()
	running := func() string {
		t.Helper()
		p, err := e.Process(ctx, sb.ID, h)
		if errors.Is(err, errdefs.ErrNotFound) {
			return "none"
		}
		if err != nil {
			t.Fatal(err)
		}
		if !p.Running {
			return "exited"
		}
		return r.ask(fmt.Sprintf("print(open('/proc/%d/comm').read().strip())", p.Pid))
	}
	if got := running(); got != "sleep" {
		t.Fatalf("before the rollbacks: the sleep is %s", got)
	}
	if err := e.Rollback(ctx, sb.ID, c.ID); err != nil {
		t.Fatal(err)
	}
	if got := running(); got != "none" {
		t.Fatalf("after the rollback to c: the sleep is %s, want none", got)
	}
	checkpoint()
	if err := e.Rollback(ctx, sb.ID, b.ID); err != nil {
		t.Fatal(err)
	}
	if got := running(); got != "sleep" {
		t.Fatalf("after the rollback to b: the sleep is %s", got)
	}
	if st := e.Stats(); st.ResidentRollbacks != 2 {
		t.Fatalf("%d of 2 rollbacks went through zygotes (restores in place %d)", st.ResidentRollbacks, st.InPlaceRestores)
	}
}

// TestPlannedRevert checks the rollbacks whose revert is planned from the head
// checkpoint's filesystem (the root unchanged since it) and those that must not be: the
// root reverted since, or data written after the head and not yet written back, to a
// file the plan would not touch. Files, the REPL and the processes are checked each time.
func TestPlannedRevert(t *testing.T) {
	e := testenv.EngineWith(t, func(c *engine.Config) { c.Standbys = -1 })
	ctx := context.Background()
	sb, r := newREPL(t, e, true)
	state := func() string {
		return r.ask("print(x, open('/f').read(), os.path.exists('/g'), open('/h').read())")
	}
	checkpoint := func() *model.Checkpoint { t.Helper(); return residentCheckpoint(t, e, sb.ID) }
	rollback := func(ck *model.Checkpoint, planned int, want string) {
		t.Helper()
		if err := e.Rollback(ctx, sb.ID, ck.ID); err != nil {
			t.Fatal(err)
		}
		st := e.Stats()
		if st.ResidentRollbacks != st.Reverts || st.PlannedReverts != planned {
			t.Errorf("after the rollback to %s: %d of %d reverts planned, want %d (%d through zygotes)",
				ck.ID, st.PlannedReverts, st.Reverts, planned, st.ResidentRollbacks)
		}
		if got := state(); got != want {
			t.Fatalf("after the rollback to %s: %q, want %q", ck.ID, got, want)
		}
	}
	r.ask("import os, time\nx = 1\nopen('/f', 'w').write('f1')\nopen('/h', 'w').write('h')")
	a := checkpoint()
	r.ask("x = 2\nopen('/f', 'w').write('f2')\nopen('/g', 'w').write('g')")
	sleep, err := e.Exec(ctx, sb.ID, model.ExecOptions{Args: []string{"sleep", "1000"}, NoStdin: true})
	if err != nil {
		t.Fatal(err)
	}
	b := checkpoint()
	// Right after b: planned. The sleep, which a does not have, is killed; its exit
	// record is undone and its record removed with the rest of what b adds.
	rollback(a, 1, "1 f1 False h")
	if _, err := e.Process(ctx, sb.ID, sleep); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("after the rollback to a, the sleep's record: %v, want not found", err)
	}
	// The root was reverted (and the REPL wrote) since a: a plain revert.
	rollback(b, 1, "2 f2 True h")
	if p, err := e.Process(ctx, sb.ID, sleep); err != nil || !p.Running {
		t.Fatalf("after the rollback to b, the sleep: %+v, %v; want running", p, err)
	}
	// The REPL sleeps through the checkpoint, then writes to /h, which a and c share:
	// only the data is new (not yet written back), and the plan from c would leave it.
	if err := e.Stdin(ctx, sb.ID, r.p, []byte("time.sleep(0.3); open('/h', 'r+').write('H')\n"), false); err != nil {
		t.Fatal(err)
	}
	checkpoint()
	time.Sleep(time.Second)
	rollback(a, 1, "1 f1 False h")
	// A checkpoint, and at once a rollback to it: nothing to revert, planned.
	d := checkpoint()
	rollback(d, 2, "1 f1 False h")
}

// TestDurableCopyLeavesRoot: the durable copy of a resident checkpoint runs CRIU inside
// the sandbox, which loads the kernel-feature cache cairn installed as its
// /run/criu.kdat: it neither probes the kernel (a directory in /tmp) nor leaves a
// /run/criu.kdat.tmp, so the root after the copy is the root before it, and a
// rollback after it can still be planned from the checkpoint's snapshot.
func TestDurableCopyLeavesRoot(t *testing.T) {
	e := testenv.EngineWith(t, func(c *engine.Config) { c.Standbys = -1 })
	ctx := context.Background()
	sb, r := newREPL(t, e, true)
	r.ask("x = 1")
	c1, err := e.Checkpoint(ctx, sb.ID, engine.CheckpointOptions{})
	if err != nil {
		t.Fatal(err)
	}
	e.Quiesce() // the durable copy
	if ck, err := e.GetCheckpoint(ctx, c1.ID); err != nil || ck.Method != "zygote-criu" {
		t.Fatalf("checkpoint after the durable copy: %+v, %v; want method zygote-criu", ck, err)
	}
	c2, err := e.Checkpoint(ctx, sb.ID, engine.CheckpointOptions{})
	if err != nil {
		t.Fatal(err)
	}
	changes, err := e.Diff(ctx, c1.ID, c2.ID)
	if err != nil {
		t.Fatal(err)
	}
	if len(changes) != 0 {
		t.Fatalf("the durable copy changed the root: %+v", changes)
	}
	if _, err := e.Stat(ctx, sb.ID, "/run/criu.kdat"); err != nil {
		t.Fatalf("/run/criu.kdat in the sandbox: %v", err)
	}
}

// residentCheckpoint checkpoints sandbox id, which must be kept resident.
func residentCheckpoint(t *testing.T, e *engine.Engine, id string) *model.Checkpoint {
	t.Helper()
	ck, err := e.Checkpoint(context.Background(), id, engine.CheckpointOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if ck.Method != "zygote" {
		got, _ := e.GetCheckpoint(context.Background(), ck.ID)
		t.Fatalf("checkpoint: method %s (%s), want zygote", ck.Method, got.MethodReason)
	}
	return ck
}

// TestRewindBesideDurableCopy rolls back to a resident checkpoint while the durable copy
// of that very checkpoint is being dumped (CRIU inside the sandbox holds its zygotes):
// the rewind in place shares the zygotes with the dump instead of waiting for it (which
// took the rollback ~100 ms), so the dump is still under way when the rollback returns;
// the state comes back, and the copy completes.
func TestRewindBesideDurableCopy(t *testing.T) {
	ctx := context.Background()
	// 64 MiB for CRIU to dump: a copy of some 100 ms.
	e, sb, r, c1 := bigREPL(t, 64)
	r.ask("x = 2")
	cur, err := e.Get(ctx, sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	procs := filepath.Join("/sys/fs/cgroup/freezer/cairn-criu", filepath.Base(cur.Root), "cgroup.procs")
	dumping := func() bool {
		b, _ := os.ReadFile(procs)
		return len(bytes.TrimSpace(b)) > 0
	}
	for deadline := time.Now().Add(10 * time.Second); !dumping(); time.Sleep(200 * time.Microsecond) {
		if time.Now().After(deadline) {
			t.Fatal("the durable copy of the checkpoint did not begin within 10 s")
		}
	}
	pctx, phases := phaseNames(ctx)
	if err := e.Rollback(pctx, sb.ID, c1.ID); err != nil {
		t.Fatal(err)
	}
	still := dumping()
	if ph := phases(); !slices.Contains(ph, "rewound") {
		t.Fatalf("the rollback was not rewound in place (phases %v)", ph)
	}
	if !still {
		t.Fatal("the durable copy had ended when the rollback returned: the rollback waited for it")
	}
	if got := r.ask("print(x, len(big))"); got != fmt.Sprint(1, 64<<20) {
		t.Fatalf("after the rollback: %q, want %q", got, fmt.Sprint(1, 64<<20))
	}
	e.Quiesce()
	if ck, err := e.GetCheckpoint(ctx, c1.ID); err != nil || ck.Method != "zygote-criu" {
		t.Fatalf("checkpoint after its durable copy: %+v, %v; want method zygote-criu", ck, err)
	}
	r.ask("x = 3")
	if err := e.Rollback(ctx, sb.ID, c1.ID); err != nil {
		t.Fatal(err)
	}
	if got := r.ask("print(x)"); got != "1" {
		t.Fatalf("after a second rollback: %q, want 1", got)
	}
}

// TestRewindRefusedForCopy: a rollback whose rewind in place would copy back more than
// the bound (zygote.maxRewindCopy, 8 MiB) forks from the zygotes instead, and says so
// (the phase rewind_refused_copy, which cairn bench counts); a small change beside it
// is rewound. Pages already scanned count before any process is stopped.
func TestRewindRefusedForCopy(t *testing.T) {
	e, sb, r, c1 := bigREPL(t, 16)
	rollback := func() []string { return rollbackPhases(t, e, sb.ID, c1) }
	r.ask("x = 2")
	if ph := rollback(); !slices.Contains(ph, "rewound") || slices.Contains(ph, "rewind_refused_copy") {
		t.Fatalf("a rollback over one small change: phases %v, want rewound", ph)
	}
	if got := r.ask("print(x, big[0], big[-1])"); got != "1 122 122" {
		t.Fatalf("after the rewind: %q, want 1 122 122", got)
	}
	r.ask("x = 3\nbig[:] = b'y' * len(big)")
	ph := rollback()
	if slices.Contains(ph, "rewound") || !slices.Contains(ph, "rewind_refused_copy") || !slices.Contains(ph, "spawn") {
		t.Fatalf("a rollback over 16 MiB written: phases %v, want rewind_refused_copy and spawn", ph)
	}
	if got := r.ask("print(x, big[0], big[-1])"); got != "1 122 122" {
		t.Fatalf("after the fork: %q, want 1 122 122", got)
	}
	// 16 MiB written again and scanned by a checkpoint (the new process's set for c1
	// holds them): refused before the rewind stops any process.
	r.ask("x = 4\nbig[:] = b'w' * len(big)")
	residentCheckpoint(t, e, sb.ID)
	ph = rollback()
	if slices.Contains(ph, "rewind_stop") || !slices.Contains(ph, "rewind_refused_copy") || !slices.Contains(ph, "spawn") {
		t.Fatalf("a rollback over 16 MiB written and scanned: phases %v, want rewind_refused_copy without rewind_stop, and spawn", ph)
	}
	if got := r.ask("print(x, big[0], big[-1])"); got != "1 122 122" {
		t.Fatalf("after the second fork: %q, want 1 122 122", got)
	}
}

// TestRewindAffinity: while traced, a process runs on the tracer's CPU, but a rewind
// compares its own CPU affinity with its zygote's. Unchanged since the checkpoint, the
// rollback is rewound in place; changed (sched_setaffinity, which a rewind cannot set
// back), the processes are forked from the zygotes instead, with the checkpoint's.
func TestRewindAffinity(t *testing.T) {
	if runtime.NumCPU() < 2 {
		t.Skip("needs two CPUs")
	}
	e, sb, r, c1 := bigREPL(t, 1)
	// (os is imported after the checkpoint: each statement imports it again.)
	want := r.ask("import os; print(sorted(os.sched_getaffinity(0)))")
	if want != cpuList(runtime.NumCPU()) {
		t.Fatalf("the REPL runs on CPUs %s, want all %d", want, runtime.NumCPU())
	}
	r.ask("x = 2")
	if ph := rollbackPhases(t, e, sb.ID, c1); !slices.Contains(ph, "rewound") {
		t.Fatalf("a rollback over a small change: phases %v, want rewound", ph)
	}
	if got := r.ask("import os; print(x, sorted(os.sched_getaffinity(0)))"); got != "1 "+want {
		t.Fatalf("after the rewind: %q, want %q", got, "1 "+want)
	}
	r.ask("import os; x = 3; os.sched_setaffinity(0, {0})")
	if ph := rollbackPhases(t, e, sb.ID, c1); slices.Contains(ph, "rewound") || !slices.Contains(ph, "spawn") {
		t.Fatalf("a rollback over a changed CPU affinity: phases %v, want spawn, not rewound", ph)
	}
	if got := r.ask("import os; print(x, sorted(os.sched_getaffinity(0)))"); got != "1 "+want {
		t.Fatalf("after the fork: %q, want %q", got, "1 "+want)
	}
}

// cpuList is [0 1 ... n-1] as Python prints a sorted list of them.
func cpuList(n int) string {
	var b strings.Builder
	b.WriteString("[")
	for i := range n {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprint(&b, i)
	}
	b.WriteString("]")
	return b.String()
}

// TestRewindAfterFork: a rollback that forks new processes from the zygotes does not
// end the rewinds. The new processes are tracked from their birth, against their own
// checkpoint and against every other of theirs: with c1 (x=1, big all 'z') and c2
// (x=2, its first MiB 'a'), a rollback to c1 over 16 MiB written forks; the rollback to
// c2 that follows is rewound in place (it brings back c2's MiB, which the new process
// never wrote), and so is one to c1 after it.
func TestRewindAfterFork(t *testing.T) {
	e, sb, r, c1 := bigREPL(t, 16)
	r.ask("x = 2\nbig[:1 << 20] = b'a' * (1 << 20)")
	c2 := residentCheckpoint(t, e, sb.ID)
	rollback := func(ck *model.Checkpoint) []string { return rollbackPhases(t, e, sb.ID, ck) }
	r.ask("x = 3\nbig[:] = b'y' * len(big)")
	if ph := rollback(c1); slices.Contains(ph, "rewound") || !slices.Contains(ph, "spawn_track") {
		t.Fatalf("a rollback to c1 over 16 MiB written: phases %v, want a fork (spawn) that tracks its processes", ph)
	}
	if got := r.ask("print(x, big[0], big[(1 << 20) - 1], big[1 << 20], big[-1])"); got != "1 122 122 122 122" {
		t.Fatalf("after the fork to c1: %q, want 1 122 122 122 122", got)
	}
	r.ask("x = 4")
	if ph := rollback(c2); !slices.Contains(ph, "rewound") {
		t.Fatalf("the rollback to c2 after a fork was not rewound in place: phases %v", ph)
	}
	if got := r.ask("print(x, big[0], big[(1 << 20) - 1], big[1 << 20], big[-1])"); got != "2 97 97 122 122" {
		t.Fatalf("after the rewind to c2: %q, want 2 97 97 122 122", got)
	}
	r.ask("x = 5\nbig[-1] = 0")
	if ph := rollback(c1); !slices.Contains(ph, "rewound") {
		t.Fatalf("the rollback to c1 after the rewind to c2 was not rewound in place: phases %v", ph)
	}
	if got := r.ask("print(x, big[0], big[(1 << 20) - 1], big[1 << 20], big[-1])"); got != "1 122 122 122 122" {
		t.Fatalf("after the rewind to c1: %q, want 1 122 122 122 122", got)
	}
}

// TestRewindLocks: a rewind gives the process back the POSIX locks it held at the
// checkpoint: one released since is taken again, one still held is left as it is, and
// one on a file the root's revert recreated is taken again on the new file. held()
// asks a child of the REPL whether it can take the lock itself.
func TestRewindLocks(t *testing.T) {
	e := testenv.EngineWith(t, func(c *engine.Config) { c.Standbys = -1 })
	sb, r := newREPL(t, e, true)
	r.ask(`import fcntl, os
f = open('/lk', 'w+')
f.write('x' * 100)
f.flush()
fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB, 10, 0)
def held():
    pid = os.fork()
    if pid == 0:
        try:
            fcntl.lockf(open('/lk', 'r+'), fcntl.LOCK_EX | fcntl.LOCK_NB, 10, 0)
            os._exit(0)
        except OSError:
            os._exit(1)
    return os.waitpid(pid, 0)[1] >> 8 == 1

x = 1`)
	if got := r.ask("print(held())"); got != "True" {
		t.Fatalf("before the checkpoint: held() = %q, want True", got)
	}
	c1 := residentCheckpoint(t, e, sb.ID)
	rollback := func(what string) {
		t.Helper()
		if ph := rollbackPhases(t, e, sb.ID, c1); !slices.Contains(ph, "rewound") {
			t.Fatalf("%s: the rollback was not rewound in place: phases %v", what, ph)
		}
		if got := r.ask("print(x, held(), os.stat('/lk').st_size)"); got != "1 True 100" {
			t.Fatalf("%s: after the rewind: %q, want 1 True 100", what, got)
		}
	}
	r.ask("fcntl.lockf(f, fcntl.LOCK_UN, 10, 0)\nx = 2")
	if got := r.ask("print(held())"); got != "False" {
		t.Fatalf("after the unlock: held() = %q, want False", got)
	}
	rollback("the lock released since")
	r.ask("x = 3")
	rollback("the lock still held")
	r.ask("os.unlink('/lk')\nx = 4")
	rollback("the file deleted since")
}

// rollbackPhases rolls sandbox id back to ck and returns the names of the phases the
// rollback reported.
func rollbackPhases(t *testing.T, e *engine.Engine, id string, ck *model.Checkpoint) []string {
	t.Helper()
	ctx, phases := phaseNames(context.Background())
	if err := e.Rollback(ctx, id, ck.ID); err != nil {
		t.Fatal(err)
	}
	return phases()
}

// phaseNames returns ctx with a phase recorder, and what returns the names of the
// phases reported to it so far.
func phaseNames(ctx context.Context) (context.Context, func() []string) {
	var mu sync.Mutex
	var names []string
	ctx = phase.With(ctx, func(name string, d time.Duration) {
		mu.Lock()
		names = append(names, name)
		mu.Unlock()
	})
	return ctx, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(names)
	}
}

// bigREPL starts a REPL holding x = 1 and big, a bytearray of mib MiB of b'z', on an
// engine without standbys, and takes a resident checkpoint of it.
func bigREPL(t *testing.T, mib int) (*engine.Engine, *model.Sandbox, *repl, *model.Checkpoint) {
	t.Helper()
	e := testenv.EngineWith(t, func(c *engine.Config) { c.Standbys = -1 })
	sb, r := newREPL(t, e, true)
	r.ask(fmt.Sprintf("x = 1\nbig = bytearray(b'z' * (%d << 20))", mib))
	return e, sb, r, residentCheckpoint(t, e, sb.ID)
}
