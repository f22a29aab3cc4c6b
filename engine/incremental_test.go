package engine_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/internal/testenv"
)

// TestIncrementalImages takes a chain of checkpoints of a sandbox whose process holds
// 48 MiB and changes ~1 MiB per step, waits for the background compaction, and checks
// that the images shrank, that rolling back to each checkpoint restores its memory
// through the chain (no standbys: every rollback is a CRIU restore), and that taking a
// checkpoint out of the middle of the chain leaves its descendants restorable. Images
// on the data directory's filesystem (no image pool): incremental chains.
func TestIncrementalImages(t *testing.T) {
	// The CRIU path's images: every checkpoint a dump of the tree (no zygotes).
	e := testenv.EngineWith(t, func(c *engine.Config) { c.Standbys, c.Residents, c.ImagePool = -1, -1, "none" })
	ctx := context.Background()
	sb, r := newREPL(t, e, true)
	state := func() string { return r.ask(bufferState) }
	const steps = 4
	cks, states := bufferCheckpoints(t, e, sb.ID, r, steps)
	e.Quiesce()
	get := func(id string) *model.Checkpoint {
		ck, err := e.GetCheckpoint(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		return ck
	}
	full := get(cks[0].ID)
	if full.Method != "criu-full" {
		t.Fatalf("first checkpoint (no parent): method %s, want criu-full", full.Method)
	}
	for k, c := range cks[1:] {
		got := get(c.ID)
		t.Logf("checkpoint %d: %s, depth %d, %d image bytes (dumped %d)", k+2, got.Method, got.ImagesDepth, got.ImageBytes, c.ImageBytes)
		if got.Method != "criu-incremental" || got.ImagesDepth != k+1 || got.ImageBytes > full.ImageBytes/4 {
			t.Fatalf("checkpoint %d after compaction: %+v; want criu-incremental at depth %d, under a quarter of %d bytes", k+2, got, k+1, full.ImageBytes)
		}
	}
	st := e.Stats()
	t.Logf("compactions %d, %.0f ms, %d bytes saved", st.Compactions, st.CompactionMS, st.CompactionSavedBytes)
	if st.Compactions < steps-1 {
		t.Fatalf("stats count %d compactions, want %d", st.Compactions, steps-1)
	}

	for _, k := range []int{3, 1, 2, 0} {
		if err := e.Rollback(ctx, sb.ID, cks[k].ID); err != nil {
			t.Fatalf("rollback to checkpoint %d: %v", k+1, err)
		}
		if got := state(); got != states[k] {
			t.Fatalf("after rollback to checkpoint %d: %q, want %q", k+1, got, states[k])
		}
	}

	// Take checkpoint 2 out of the chain: 3 and 4 are rebased and still restore.
	if err := e.DeleteCheckpointsForTest(ctx, cks[1].ID); err != nil {
		t.Fatal(err)
	}
	if got := get(cks[2].ID); got.Parent != cks[0].ID || got.ImagesDepth != 1 {
		t.Fatalf("checkpoint 3 after deleting 2: parent %s depth %d, want %s depth 1", got.Parent, got.ImagesDepth, cks[0].ID)
	}
	for _, k := range []int{2, 3} {
		if err := e.Rollback(ctx, sb.ID, cks[k].ID); err != nil {
			t.Fatalf("rollback to checkpoint %d after deleting 2: %v", k+1, err)
		}
		if got := state(); got != states[k] {
			t.Fatalf("after rollback to checkpoint %d: %q, want %q", k+1, got, states[k])
		}
	}
	// And the public path: the chain's root, with cascade.
	if _, err := e.DeleteCheckpoint(ctx, cks[0].ID, true); err != nil {
		t.Fatal(err)
	}
	if l := e.Leftovers(); len(l) > 0 {
		t.Fatalf("leftovers after deleting the chain: %v", l)
	}
}

// bufferState prints the state of bufferCheckpoints' REPL: its step and buffer.
const bufferState = "print(step, hashlib.sha256(b).hexdigest())"

// bufferCheckpoints fills the REPL with a 48 MiB buffer, then takes n checkpoints of the
// sandbox, each after rewriting 1 MiB of it; it returns them with the state each holds.
func bufferCheckpoints(t *testing.T, e *engine.Engine, sb string, r *repl, n int) ([]*model.Checkpoint, []string) {
	t.Helper()
	r.ask("import hashlib\nb = bytearray(48 << 20)\nfor i in range(0, len(b), 4096): b[i:i+8] = i.to_bytes(8, 'little')\n")
	var cks []*model.Checkpoint
	var states []string
	for k := 1; k <= n; k++ {
		r.ask(fmt.Sprintf("step = %d\nb[%d << 20:%d << 20] = bytes([%d]) * (1 << 20)", k, k, k+1, k))
		states = append(states, r.ask(bufferState))
		ck, err := e.Checkpoint(context.Background(), sb, engine.CheckpointOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cks = append(cks, ck)
	}
	return cks, states
}

// repl drives a Python REPL in a sandbox.
// newREPL creates a container sandbox running a Python REPL (python3 -i -u), removed at
// the end of the test if remove.
func newREPL(t *testing.T, e *engine.Engine, remove bool) (*model.Sandbox, *repl) {
	t.Helper()
	ctx := context.Background()
	sb, err := e.Create(ctx, model.CreateOptions{Isolation: "container"})
	if err != nil {
		t.Fatal(err)
	}
	if remove {
		t.Cleanup(func() { e.Remove(context.Background(), sb.ID) })
	}
	p, err := e.Exec(ctx, sb.ID, model.ExecOptions{Args: []string{"python3", "-i", "-u"}})
	if err != nil {
		t.Fatal(err)
	}
	return sb, &repl{t: t, e: e, sb: sb.ID, p: p}
}

type repl struct {
	t     *testing.T
	e     *engine.Engine
	sb, p string
	seq   int
}

// ask sends code and returns what it printed, up to a fresh marker; output from before
// (another generation of the process, after a rollback) is skipped.
func (r *repl) ask(code string) string {
	r.t.Helper()
	ctx := context.Background()
	r.seq++
	marker := fmt.Sprintf("@@incr-%d-%d@@", time.Now().UnixNano(), r.seq)
	_, off, err := r.e.Output(ctx, r.sb, r.p, "stdout", 0)
	if err != nil {
		r.t.Fatal(err)
	}
	if err := r.e.Stdin(ctx, r.sb, r.p, []byte(code+"\n\nprint("+fmt.Sprintf("%q", marker)+")\n"), false); err != nil {
		r.t.Fatal(err)
	}
	var got strings.Builder
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		b, next, err := r.e.Output(ctx, r.sb, r.p, "stdout", off)
		if err != nil {
			r.t.Fatal(err)
		}
		got.Write(b)
		off = next
		if i := strings.Index(got.String(), marker); i >= 0 {
			return strings.TrimSpace(got.String()[:i])
		}
	}
	r.t.Fatalf("REPL did not answer %q; stdout so far %q", code, got.String())
	return ""
}

// TestSharedImages is TestIncrementalImages on the image pool, for both kinds of
// images: tree dumps (no zygotes), and the durable copies of resident checkpoints. Each
// checkpoint's images after the first share their unchanged pages with their parent's
// (method criu-shared, or zygote-criu, with a fraction of the bytes), stay full (no
// parent link), and restore alone: deleting a checkpoint in the middle rebases nothing.
func TestSharedImages(t *testing.T) {
	for _, resident := range []bool{false, true} {
		t.Run(map[bool]string{false: "tree", true: "resident"}[resident], func(t *testing.T) {
			e := testenv.EngineWith(t, func(c *engine.Config) {
				c.Standbys = -1
				if !resident {
					c.Residents = -1
				}
			})
			ctx := context.Background()
			sb, r := newREPL(t, e, true)
			cks, states := bufferCheckpoints(t, e, sb.ID, r, 3)
			for k, ck := range cks {
				if !strings.HasPrefix(ck.Images, "imgs/") {
					t.Fatalf("checkpoint %d's images are in %s, not on the image pool (imgs/)", k+1, ck.Images)
				}
			}
			e.Quiesce()
			var first int64
			for k, c := range cks {
				got, err := e.GetCheckpoint(ctx, c.ID)
				if err != nil {
					t.Fatal(err)
				}
				want := map[bool]string{false: "criu-shared", true: "zygote-criu"}[resident]
				if k == 0 {
					first = got.ImageBytes
					want = map[bool]string{false: "criu-full", true: "zygote-criu"}[resident]
				}
				t.Logf("checkpoint %d: %s, %d image bytes of its own", k+1, got.Method, got.ImageBytes)
				if got.Method != want || got.ImagesDepth != 0 || k > 0 && got.ImageBytes > first/4 {
					t.Fatalf("checkpoint %d: %s at depth %d, %d bytes; want %s at depth 0, under a quarter of the first's %d", k+1, got.Method, got.ImagesDepth, got.ImageBytes, want, first)
				}
			}
			// The middle one goes: no rebase, the others restore on their own.
			if err := e.DeleteCheckpointsForTest(ctx, cks[1].ID); err != nil {
				t.Fatal(err)
			}
			if resident {
				if err := e.Settle(ctx, sb.ID); err != nil { // rollbacks restore images
					t.Fatal(err)
				}
			}
			for _, k := range []int{2, 0, 2} {
				if err := e.Rollback(ctx, sb.ID, cks[k].ID); err != nil {
					t.Fatalf("rollback to checkpoint %d: %v", k+1, err)
				}
				if got := r.ask(bufferState); got != states[k] {
					t.Fatalf("after rollback to checkpoint %d: %q, want %q", k+1, got, states[k])
				}
			}
			if _, err := e.DeleteCheckpoint(ctx, cks[0].ID, true); err != nil {
				t.Fatal(err)
			}
			if l := e.Leftovers(); len(l) > 0 {
				t.Fatalf("leftovers after deleting the checkpoints: %v", l)
			}
		})
	}
}
