package conformance

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
)

// CrashEnv carries "SANDBOX:POINT" to a crash-test child process, which checkpoints
// the sandbox, "SANDBOX:POINT:CHECKPOINT", which rolls it back to CHECKPOINT, or
// "SANDBOX:POINT:rewind:PROCESS" (crashRewind).
const CrashEnv = "CAIRN_CONFORMANCE_CRASH"

// CrashMain is called by a backend test's TestMain. In a crash-test child (CrashEnv
// set) it checkpoints (or rolls back) the sandbox with the engine told to die at POINT,
// lets its background work run (a checkpoint's durable copy), and never returns;
// otherwise it returns at once.
func CrashMain(open func() (*engine.Engine, error)) {
	v := os.Getenv(CrashEnv)
	if v == "" {
		return
	}
	parts := strings.SplitN(v, ":", 4)
	id, point := parts[0], parts[1]
	os.Setenv("CAIRN_TEST_CRASH_AT", point)
	e, err := open()
	if err != nil {
		os.Stderr.WriteString("crash child: " + err.Error() + "\n")
		os.Exit(3)
	}
	what := "checkpoint"
	switch {
	case len(parts) == 4 && parts[2] == "rewind":
		what = "rewind"
		err = crashRewind(e, id, parts[3])
	case len(parts) == 3:
		what = "rollback"
		err = e.Rollback(context.Background(), id, parts[2])
	default:
		_, err = e.Checkpoint(context.Background(), id, engine.CheckpointOptions{Label: "doomed"})
	}
	e.Close() // background work: the crash may be there
	os.Stderr.WriteString("crash child: " + what + " returned without crashing: " + errString(err) + "\n")
	os.Exit(4)
}

// crashRewind is the child of a crash in the middle of a rewind: a rewind needs the
// processes' writes tracked by the engine that rolls back, so the child checkpoints
// the sandbox itself ("rewind-target"), changes the REPL proc's x and /file (x = 3,
// "three"), and rolls back to its checkpoint, a rewind, which dies at its point.
func crashRewind(e *engine.Engine, id, proc string) error {
	ctx := context.Background()
	ck, err := e.Checkpoint(ctx, id, engine.CheckpointOptions{Label: "rewind-target"})
	if err != nil {
		return err
	}
	if _, err := tell(ctx, e, id, proc, `x = 3; open("/file", "w").write("three\n")`); err != nil {
		return err
	}
	return e.Rollback(ctx, id, ck.ID)
}

func errString(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}

func testCrash(t *testing.T, h Harness) {
	if h.Crash == nil {
		t.Fatal("the harness has no crash runner")
	}
	ctx := context.Background()
	id, p := replSandbox(t, h)
	ask(t, h, id, p, "x = 1")
	good := checkpoint(t, h, id, "good")
	points := []string{"checkpoint-stopped", "checkpoint-frozen", "checkpoint-staged", "checkpoint-published"}
	switch {
	case h.Resident:
		// The checkpoint is committed; its durable copy is written, not recorded: the next
		// engine records it (the zygotes survive cairn).
		points = append(points, "durable-written")
	case h.Isolation == "container":
		// CRIU has written the images and still holds the tree (ptrace): the crash leaves
		// it to a CRIU whose caller is gone.
		points = append(points, "checkpoint-dumped")
	}
	for _, point := range points {
		t.Run(point, func(t *testing.T) {
			h.Crash(t, id, point)
			// The crashed checkpoint is invisible, and the next engine's recovery removes
			// its files; the sandbox was thawed and answers.
			e2, err := h.Reopen()
			if err != nil {
				t.Fatalf("reopen after crash: %v", err)
			}
			defer e2.Close()
			tree, err := e2.Tree(ctx, id)
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range tree {
				if c.Label != "doomed" {
					continue
				}
				if point != "durable-written" {
					t.Fatalf("half checkpoint %s is listed after a crash at %s", c.ID, point)
				}
				// Committed before the crash: it stays, made durable by the new engine.
				if _, err := e2.DeleteCheckpoint(ctx, c.ID, false); err != nil {
					t.Fatal(err)
				}
				e2.Quiesce()
			}
			if leftovers := e2.Leftovers(); len(leftovers) > 0 {
				t.Fatalf("leftovers after recovery from a crash at %s: %v", point, leftovers)
			}
			sb, err := e2.Get(ctx, id)
			if err != nil || sb.State != model.StateRunning || sb.Head != good {
				t.Fatalf("sandbox after crash: %+v %v (want running, head %s)", sb, err, good)
			}
			want(t, "REPL after crash", ask(t, h, id, p, "x += 1; print(x)"), "2")
			rollback(t, h, id, good)
			want(t, "REPL after rollback", ask(t, h, id, p, "print(x)"), "1")
		})
	}
}

func wantClass(t *testing.T, what string, err error, class error) {
	t.Helper()
	if !errors.Is(err, class) {
		t.Fatalf("%s: got error %v, want class %q", what, err, errdefs.Code(class))
	}
	if len(err.Error()) < 10 {
		t.Fatalf("%s: error message %q says too little", what, err)
	}
}

func testBadInput(t *testing.T, h Harness) {
	ctx := context.Background()
	e := h.Engine
	id := sandbox(t, h)
	other := sandbox(t, h)
	p := spawn(t, h, id, "python3", "-i", "-u")
	ask(t, h, id, p, "x = 5")
	sh(t, h, id, "echo keep > /workspace/keep && ln -s ../../../../../etc/passwd /workspace/up && ln -s /etc/hostname /workspace/abs")
	mine := checkpoint(t, h, id, "mine")
	theirs := checkpoint(t, h, other, "theirs")
	before, _ := e.Tree(ctx, id)

	_, err := e.Get(ctx, "nosuchsandbox")
	wantClass(t, "get unknown sandbox", err, errdefs.ErrNotFound)
	_, err = e.Get(ctx, "../etc")
	wantClass(t, "get malformed ID", err, errdefs.ErrInvalidArgument)
	_, err = e.Checkpoint(ctx, "nosuchsandbox", engine.CheckpointOptions{})
	wantClass(t, "checkpoint unknown sandbox", err, errdefs.ErrNotFound)
	wantClass(t, "rollback to unknown checkpoint", e.Rollback(ctx, id, "nosuchcheckpoint"), errdefs.ErrNotFound)
	wantClass(t, "rollback to another sandbox's checkpoint", e.Rollback(ctx, id, theirs), errdefs.ErrInvalidArgument)
	_, err = e.Fork(ctx, mine, 0)
	wantClass(t, "fork 0", err, errdefs.ErrInvalidArgument)
	_, err = e.Fork(ctx, mine, 10000)
	wantClass(t, "fork 10000", err, errdefs.ErrInvalidArgument)
	_, err = e.Fork(ctx, "nosuchcheckpoint", 1)
	wantClass(t, "fork unknown checkpoint", err, errdefs.ErrNotFound)
	_, err = e.ReadFile(ctx, id, "/workspace/../../etc/shadow")
	wantClass(t, "read with ..", err, errdefs.ErrInvalidArgument)
	_, err = e.ReadFile(ctx, id, "/workspace/up")
	wantClass(t, "read through escaping symlink", err, errdefs.ErrPermissionDenied)
	wantClass(t, "write through escaping symlink", e.WriteFile(ctx, id, "/workspace/up", []byte("x"), 0o644), errdefs.ErrPermissionDenied)
	wantClass(t, "write with ..", e.WriteFile(ctx, id, "../../tmp/x", []byte("x"), 0o644), errdefs.ErrInvalidArgument)
	wantClass(t, "remove root", e.RemovePath(ctx, id, "/"), errdefs.ErrInvalidArgument)
	_, err = e.Exec(ctx, id, model.ExecOptions{})
	wantClass(t, "exec without command", err, errdefs.ErrInvalidArgument)
	wantClass(t, "stdin to unknown process", e.Stdin(ctx, id, "pnosuch", []byte("x"), false), errdefs.ErrNotFound)
	_, err = e.Create(ctx, model.CreateOptions{Template: "nosuchtemplate"})
	wantClass(t, "create from unknown template", err, errdefs.ErrNotFound)
	_, err = e.Create(ctx, model.CreateOptions{Isolation: "vm"})
	wantClass(t, "create with unknown isolation", err, errdefs.ErrInvalidArgument)
	_, err = e.DeleteCheckpoint(ctx, "nosuchcheckpoint", false)
	wantClass(t, "delete unknown checkpoint", err, errdefs.ErrNotFound)

	// Nothing changed: the sandbox runs on with its state, files and tree.
	want(t, "REPL", ask(t, h, id, p, "print(x)"), "5")
	want(t, "file", sh(t, h, id, "cat /workspace/keep"), "keep\n")
	if _, err := os.Stat("/etc/passwd"); err != nil {
		t.Fatal(err)
	}
	after, _ := e.Tree(ctx, id)
	if len(after) != len(before) {
		t.Fatalf("tree changed from %d to %d checkpoints", len(before), len(after))
	}
	// An absolute symlink resolves inside the sandbox, as the sandbox sees it.
	b, err := e.ReadFile(ctx, id, "/workspace/abs")
	if err == nil && strings.TrimSpace(string(b)) != id {
		t.Fatalf("absolute symlink read %q, want the sandbox's hostname", b)
	}
}
