package engine_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/cairn-sandbox/cairn/criu/incremental"
	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/internal/testenv"
)

// TestResidentImages takes a chain of resident checkpoints of a process holding 48 MiB
// that changes ~1 MiB per step, waits for their durable copies and compaction, and
// checks that each copy after the first is incremental against its parent's images of
// the same process and small; that, with the zygotes ended, every checkpoint is
// restored from its images (fork, rollback); and that deleting a checkpoint in the
// middle rebases its child's images, which stay restorable.
func TestResidentImages(t *testing.T) {
	e := testenv.EngineWith(t, func(c *engine.Config) { c.Standbys = -1 })
	ctx := context.Background()
	sb, err := e.Create(ctx, model.CreateOptions{Isolation: "container"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Remove(context.Background(), sb.ID) })
	p, err := e.Exec(ctx, sb.ID, model.ExecOptions{Args: []string{"python3", "-i", "-u"}})
	if err != nil {
		t.Fatal(err)
	}
	r := &repl{t: t, e: e, sb: sb.ID, p: p}
	r.ask("import hashlib\nb = bytearray(48 << 20)\nfor i in range(0, len(b), 4096): b[i:i+8] = i.to_bytes(8, 'little')\n")
	state := func(r *repl) string { return r.ask("print(step, hashlib.sha256(b).hexdigest())") }
	const steps = 3
	var cks []*model.Checkpoint
	var states []string
	for k := 1; k <= steps; k++ {
		r.ask(fmt.Sprintf("step = %d\nb[%d << 20:%d << 20] = bytes([%d]) * (1 << 20)", k, k, k+1, k))
		states = append(states, state(r))
		ck, err := e.Checkpoint(ctx, sb.ID, engine.CheckpointOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if ck.Method != "zygote" {
			t.Fatalf("checkpoint %d: method %s, want zygote (resident)", k, ck.Method)
		}
		cks = append(cks, ck)
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
		kr := &repl{t: t, e: e, sb: kids[0].ID, p: p}
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
