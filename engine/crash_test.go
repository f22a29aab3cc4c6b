package engine_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/cairn-sandbox/cairn/criu/incremental"
	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/internal/testenv"
)

// rewriteCrashEnv names, in a TestRewriteCrash child process, the case it runs.
const rewriteCrashEnv = "CAIRN_REWRITE_CRASH"

// rewriteCrashes are the moments of the background image rewrites a crash is tested
// at. Compactions die while compacting checkpoint 3 against checkpoint 2 (itself
// already incremental against 1); rebases die while a checkpoint is deleted (delete,
// 0-based): deleting 2 rebases 3 onto 1, deleting 1 (the chain's root) flattens 2.
var rewriteCrashes = []struct {
	name   string
	at     string // CAIRN_TEST_CRASH_AT: a point of criu/incremental or of the engine
	delete int    // the checkpoint deleted, or -1 for a crash in a compaction
	shared bool   // images on the image pool (incremental.Share), not in chains
}{
	{"compact-start", "compact-start", -1, false},         // queued, nothing done
	{"compact-written", "incremental-pagemap", -1, false}, // new files written, none switched
	{"compact-linked", "incremental-link", -1, false},     // parent link made, none switched
	{"compact-switched", "incremental-switch", -1, false}, // one task switched, old pages kept
	{"compact-done", "compact-done", -1, false},           // rewritten, row still criu-full
	{"rebase-written", "incremental-pagemap", 1, false},
	{"rebase-switched", "incremental-switch", 1, false},
	{"rebase-unlinked", "incremental-unlink", 1, false}, // all switched, link not yet moved
	{"rebase-done", "rebase-done", 1, false},            // rebased, row not updated, victim's images kept
	{"flatten-switched", "incremental-switch", 0, false},
	{"flatten-done", "rebase-done", 0, false},
	{"share-start", "compact-start", -1, true}, // queued, nothing done
	{"share-pages", "share-pages", -1, true},   // one pages file rebuilt, not renamed
	{"share-done", "compact-done", -1, true},   // shared, row still criu-full
}

// imagePool is the engine's ImagePool for a case.
func imagePool(shared bool) string {
	if shared {
		return ""
	}
	return "none"
}

// TestRewriteCrash kills the engine (SIGKILL, in a child process) at each moment of
// rewriteCrashes, reopens it, and checks that recovery left no rewrite leftovers, that
// every checkpoint's row agrees with its images on disk (method, parent link, depth,
// bytes) and that compaction was finished, and that rolling back to each checkpoint
// (a CRIU restore: no standbys) gives the REPL state it was taken with.
func TestRewriteCrash(t *testing.T) {
	if c := os.Getenv(rewriteCrashEnv); c != "" {
		rewriteCrashChild(t, c)
		return
	}
	noStandbys := func(c *engine.Config) { c.Standbys = -1 }
	e := testenv.EngineWith(t, noStandbys)
	ctx := context.Background()
	for _, tc := range rewriteCrashes {
		t.Run(tc.name, func(t *testing.T) {
			noStandbys := func(c *engine.Config) { c.Standbys, c.ImagePool = -1, imagePool(tc.shared) }
			cmd := exec.Command(os.Args[0], "-test.run=^TestRewriteCrash$", "-test.v")
			cmd.Env = append(os.Environ(), rewriteCrashEnv+"="+tc.name)
			out, err := cmd.CombinedOutput()
			got := childReport(string(out))
			if sb := got["sandbox"]; sb != "" {
				t.Cleanup(func() { removeWithCheckpoints(e, sb) })
			}
			if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != -1 {
				t.Fatalf("crash child at %s did not die by signal: %v: %s", tc.at, err, out)
			}
			cfg := testenv.Config(t)
			noStandbys(&cfg)
			e2, err := engine.Open(ctx, cfg)
			if err != nil {
				t.Fatalf("reopen after crash: %v", err)
			}
			defer e2.Close()
			e2.Quiesce()
			if l := e2.Leftovers(); len(l) > 0 {
				t.Fatalf("leftovers after recovery: %v", l)
			}
			tree, err := e2.Tree(ctx, got["sandbox"])
			if err != nil {
				t.Fatal(err)
			}
			var labels, wantLabels []string
			for _, c := range tree {
				labels = append(labels, c.Label)
			}
			for k := 1; k <= 3; k++ {
				if k-1 != tc.delete {
					wantLabels = append(wantLabels, fmt.Sprintf("step-%d", k))
				}
			}
			sort.Strings(labels)
			if d := cmp.Diff(wantLabels, labels); d != "" {
				t.Fatalf("checkpoints after recovery (-want +got):\n%s", d)
			}
			for _, c := range tree {
				checkImages(t, e2, c, tc.shared)
			}
			r := &repl{t: t, e: e2, sb: got["sandbox"], p: got["process"]}
			for _, c := range tree {
				if err := e2.Rollback(ctx, got["sandbox"], c.ID); err != nil {
					t.Fatalf("rollback to %s (%s): %v", c.Label, c.ID, err)
				}
				if s := r.ask(replState); s != got[c.Label] {
					t.Fatalf("after rollback to %s: %q, want %q", c.Label, s, got[c.Label])
				}
			}
		})
	}
}

// removeWithCheckpoints removes a sandbox and its checkpoints.
func removeWithCheckpoints(e *engine.Engine, id string) {
	ctx := context.Background()
	tree, _ := e.Tree(ctx, id)
	e.Remove(ctx, id)
	for _, c := range tree {
		if c.Parent == "" {
			e.DeleteCheckpoint(ctx, c.ID, true)
		}
	}
}

// checkImages checks that a checkpoint's row says what its images directory holds,
// and that its compaction is done: a checkpoint with a parent is incremental (the REPL
// keeps most of its pages from one checkpoint to the next), or, on the image pool,
// shares most of its pages with its parent's (no link, fewer bytes of its own than the
// directory's size).
func checkImages(t *testing.T, e *engine.Engine, c *model.Checkpoint, shared bool) {
	t.Helper()
	ctx := context.Background()
	ck, err := e.GetCheckpoint(ctx, c.ID)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(testenv.DataDir(), ck.Images)
	if shared {
		link, _ := incremental.Parent(dir)
		want := "criu-full"
		if ck.Parent != "" {
			want = "criu-shared"
		}
		size := imagesBytes(t, dir)
		if ck.Method != want || link != "" || ck.ImagesDepth != 0 || ck.Parent != "" && ck.ImageBytes > size/4 || ck.Parent == "" && ck.ImageBytes != size {
			t.Fatalf("checkpoint %s (%s): method %s, link %q, depth %d, %d bytes of its own in %d; want %s, no link, a quarter or less of the directory with a parent",
				ck.Label, ck.ID, ck.Method, link, ck.ImagesDepth, ck.ImageBytes, size, want)
		}
		return
	}
	link, err := incremental.Parent(dir)
	if err != nil {
		t.Fatal(err)
	}
	depth, err := incremental.Depth(dir)
	if err != nil {
		t.Fatal(err)
	}
	var wantLink string
	wantMethod, wantDepth := "criu-full", 0
	if ck.Parent != "" {
		p, err := e.GetCheckpoint(ctx, ck.Parent)
		if err != nil {
			t.Fatal(err)
		}
		wantLink = filepath.Join(testenv.DataDir(), p.Images)
		wantMethod, wantDepth = "criu-incremental", p.ImagesDepth+1
	}
	got := fmt.Sprintf("method %s, depth %d, link %q, %d bytes", ck.Method, ck.ImagesDepth, link, ck.ImageBytes)
	want := fmt.Sprintf("method %s, depth %d, link %q, %d bytes", wantMethod, depth, wantLink, imagesBytes(t, dir))
	if got != want || depth != wantDepth {
		t.Fatalf("checkpoint %s (%s): row and disk say %s; want %s at depth %d", ck.Label, ck.ID, got, want, wantDepth)
	}
}

func imagesBytes(t *testing.T, dir string) int64 {
	var n int64
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range ents {
		// As the engine counts: every entry's own size (the parent link's too).
		if fi, err := os.Lstat(filepath.Join(dir, d.Name())); err == nil && !fi.IsDir() {
			n += fi.Size()
		}
	}
	return n
}

// replState prints what a checkpoint of the crash test's REPL holds.
const replState = "print(step, sorted(d.items()), hashlib.sha256(b).hexdigest())"

// rewriteCrashChild runs in a child process: it takes three checkpoints of a REPL,
// reporting (on stdout, for childReport) the sandbox, the process and each checkpoint's
// REPL state, and then has the engine killed at the case's crash point.
func rewriteCrashChild(t *testing.T, name string) {
	var tc = rewriteCrashes[0]
	for _, c := range rewriteCrashes {
		if c.name == name {
			tc = c
		}
	}
	// The CRIU path's images: every checkpoint a dump of the tree (no zygotes).
	e := testenv.EngineWith(t, func(c *engine.Config) { c.Standbys, c.Residents, c.ImagePool = -1, -1, imagePool(tc.shared) })
	ctx := context.Background()
	sb, r := newREPL(t, e, false)
	fmt.Printf("crash-child sandbox %s\ncrash-child process %s\n", sb.ID, r.p)
	r.ask("import hashlib\nd = {}\nb = bytearray(16 << 20)\nfor i in range(0, len(b), 4096): b[i:i+8] = i.to_bytes(8, 'little')\n")
	var cks []*model.Checkpoint
	for k := 1; k <= 3; k++ {
		r.ask(fmt.Sprintf("step = %d\nd[%d] = 'v%d'\nb[%d << 20:%d << 20] = bytes([%d]) * (1 << 20)", k, k, k, k, k+1, k))
		label := fmt.Sprintf("step-%d", k)
		fmt.Printf("crash-child %s %s\n", label, r.ask(replState))
		if k == 3 && tc.delete < 0 {
			os.Setenv("CAIRN_TEST_CRASH_AT", tc.at) // dies compacting checkpoint 3
		}
		ck, err := e.Checkpoint(ctx, sb.ID, engine.CheckpointOptions{Label: label})
		if err != nil {
			t.Fatal(err)
		}
		cks = append(cks, ck)
		e.Quiesce()
	}
	if tc.delete >= 0 {
		os.Setenv("CAIRN_TEST_CRASH_AT", tc.at)
		if err := e.DeleteCheckpointsForTest(ctx, cks[tc.delete].ID); err != nil {
			t.Fatal(err)
		}
	}
	t.Fatalf("no crash at %s", tc.at)
}

// childReport parses the "crash-child KEY VALUE" lines of a child's output.
func childReport(out string) map[string]string {
	m := map[string]string{}
	for _, l := range strings.Split(out, "\n") {
		if rest, ok := strings.CutPrefix(l, "crash-child "); ok {
			k, v, _ := strings.Cut(rest, " ")
			m[k] = v
		}
	}
	return m
}
