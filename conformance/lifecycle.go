package conformance

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
	"golang.org/x/sys/unix"
)

func testFiles(t *testing.T, h Harness) {
	ctx := context.Background()
	e := h.Engine
	id := sandbox(t, h)
	if err := e.WriteFile(ctx, id, "/workspace/dir/a.txt", []byte("hello\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	want(t, "seen inside", sh(t, h, id, "cat /workspace/dir/a.txt; stat -c %a /workspace/dir/a.txt"), "hello\n600\n")
	sh(t, h, id, "echo inside > /workspace/dir/b.txt")
	b, err := e.ReadFile(ctx, id, "workspace/dir/b.txt")
	if err != nil || string(b) != "inside\n" {
		t.Fatalf("read: %q %v", b, err)
	}
	l, err := e.ListDir(ctx, id, "/workspace/dir")
	if err != nil || len(l) != 2 || l[0].Name != "a.txt" || l[1].Name != "b.txt" {
		t.Fatalf("list: %+v %v", l, err)
	}
	st, err := e.Stat(ctx, id, "/workspace/dir/a.txt")
	if err != nil || st.Size != 6 || st.IsDir {
		t.Fatalf("stat: %+v %v", st, err)
	}
	if err := e.RemovePath(ctx, id, "/workspace/dir"); err != nil {
		t.Fatal(err)
	}
	want(t, "removed", sh(t, h, id, "test -e /workspace/dir && echo yes || echo no"), "no\n")
	_, err = e.Stat(ctx, id, "/workspace/dir")
	wantClass(t, "stat removed", err, errdefs.ErrNotFound)
}

func testTreeDiffDelete(t *testing.T, h Harness) {
	ctx := context.Background()
	e := h.Engine
	id := sandbox(t, h)
	sh(t, h, id, "echo a > /workspace/a; echo b > /workspace/b")
	c1 := checkpoint(t, h, id, "c1")
	sh(t, h, id, "echo changed > /workspace/a; rm /workspace/b; echo c > /workspace/c")
	c2 := checkpoint(t, h, id, "c2")
	changes, err := e.Diff(ctx, c1, c2)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, c := range changes {
		if strings.HasPrefix(c.Path, "/workspace/") {
			got[c.Path] = c.Kind
		}
	}
	wantChanges := map[string]string{"/workspace/a": "changed", "/workspace/b": "deleted", "/workspace/c": "added"}
	for p, k := range wantChanges {
		if got[p] != k {
			t.Fatalf("diff: %s is %q, want %q (all: %v)", p, got[p], k, got)
		}
	}
	// Branch: roll back to c1 and checkpoint again; c3's parent is c1.
	rollback(t, h, id, c1)
	c3 := checkpoint(t, h, id, "c3")
	tree, _ := e.Tree(ctx, id)
	parents := map[string]string{}
	for _, c := range tree {
		parents[c.ID] = c.Parent
	}
	if parents[c2] != c1 || parents[c3] != c1 {
		t.Fatalf("tree parents: %v (c1=%s c2=%s c3=%s)", parents, c1, c2, c3)
	}
	// A checkpoint with children is not deleted without cascade.
	_, err = e.DeleteCheckpoint(ctx, c1, false)
	wantClass(t, "delete with children", err, errdefs.ErrFailedPrecondition)
	// Forks of c2 survive the deletion of c2 and of its whole subtree.
	f := fork(t, h, c2, 1)[0]
	if _, err := e.DeleteCheckpoint(ctx, c1, true); err != nil {
		t.Fatal(err)
	}
	want(t, "fork after its checkpoint is gone", sh(t, h, f, "cat /workspace/a /workspace/c"), "changed\nc\n")
	if err := e.Rollback(ctx, f, c2); !errorsIsNotFound(err) {
		t.Fatalf("rollback to deleted checkpoint: %v", err)
	}
	tree, _ = e.Tree(ctx, id)
	if len(tree) != 0 {
		t.Fatalf("tree after cascade delete has %d checkpoints", len(tree))
	}
	// The sandbox itself runs on.
	want(t, "sandbox after delete", sh(t, h, id, "cat /workspace/a"), "a\n")
	// GC after removing the sandbox collects its checkpoints and leaves no leftovers.
	c4 := checkpoint(t, h, id, "c4")
	if err := e.Remove(ctx, id); err != nil {
		t.Fatal(err)
	}
	rep, err := e.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, c := range rep.Checkpoints {
		found = found || c == c4
	}
	if !found {
		t.Fatalf("GC did not collect %s of a removed sandbox: %+v", c4, rep)
	}
}

func errorsIsNotFound(err error) bool { return errdefs.Code(err) == "not_found" }

func testResume(t *testing.T, h Harness) {
	ctx := context.Background()
	e := h.Engine
	id, p := replSandbox(t, h)
	ask(t, h, id, p, "x = 'kept'")
	// Durable: a resident checkpoint is otherwise in memory for a moment after it
	// returns, and the "reboot" below would take it.
	if _, err := e.Checkpoint(ctx, id, engine.CheckpointOptions{Label: "latest", Durable: true}); err != nil {
		t.Fatal(err)
	}
	// The machine "reboots": every process of the sandbox dies behind cairn's back.
	sb, _ := e.Get(ctx, id)
	if err := killTree(sb.Init.Pid); err != nil {
		t.Fatal(err)
	}
	e2, err := h.Reopen()
	if err != nil {
		t.Fatal(err)
	}
	defer e2.Close()
	sb, _ = e2.Get(ctx, id)
	if sb.State != model.StateStopped {
		t.Fatalf("state after its processes died: %s, want stopped", sb.State)
	}
	_, err = e2.Exec(ctx, id, model.ExecOptions{Args: []string{"true"}})
	wantClass(t, "exec in stopped sandbox", err, errdefs.ErrFailedPrecondition)
	if _, err := e2.Resume(ctx, id); err != nil {
		t.Fatal(err)
	}
	want(t, "REPL after resume", ask(t, h, id, p, "print(x)"), "kept")
}

// killTree kills a sandbox's init (and so its whole pid namespace) and waits for it.
func killTree(pid int) error {
	if err := unix.Kill(pid, unix.SIGKILL); err != nil {
		return err
	}
	for i := 0; i < 5000; i++ {
		if unix.Kill(pid, 0) != nil {
			return nil
		}
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if strings.Contains(string(b), ") Z ") {
			return nil
		}
		time.Sleep(time.Millisecond)
	}
	return fmt.Errorf("pid %d did not die", pid)
}
