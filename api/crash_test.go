package api_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/internal/testenv"
)

// TestKillDuringCheckpoint: cairnd is SIGKILLed while sandboxes run and a checkpoint
// is in flight (frozen, filesystem half taken). The caller gets an error, not a hang;
// after a restart nothing is lost (the sandboxes run, their REPLs hold their state),
// no half checkpoint is listed or left on disk, and checkpoints work again.
func TestKillDuringCheckpoint(t *testing.T) {
	ctx := context.Background()
	d := startDaemon(t, nil)
	a := newSandbox(t, d.c, client.CreateRequest{Labels: map[string]string{"test": "crash"}})
	b := newSandbox(t, d.c, client.CreateRequest{Labels: map[string]string{"test": "crash"}})
	ha, hb := repl(t, d.c, a.ID), repl(t, d.c, b.ID)
	send(t, d.c, a.ID, ha, "x = 41")
	send(t, d.c, b.ID, hb, "y = 'b'")
	c1, err := d.c.Checkpoint(ctx, a.ID, client.CheckpointRequest{Label: "before-crash"})
	if err != nil {
		t.Fatal(err)
	}
	replValue(t, d.c, b.ID, hb, "y")
	if err := d.stop(); err != nil {
		t.Fatal(err)
	}

	// The engine kills its own process (SIGKILL) at this line of the checkpoint.
	crashing := startDaemon(t, []string{"CAIRN_TEST_CRASH_AT=checkpoint-frozen"})
	cctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	_, err = crashing.c.Checkpoint(cctx, a.ID, client.CheckpointRequest{Label: "in-flight"})
	cancel()
	if err == nil || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("checkpoint in flight when cairnd died: %v (want an error, not a hang)", err)
	}
	t.Logf("the in-flight call got: %v", err)
	werr := <-crashing.exit
	crashing.exit <- werr
	var ee *exec.ExitError
	if !errors.As(werr, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("cairnd did not die by SIGKILL: %v", werr)
	}

	d2 := startDaemon(t, nil)
	t.Cleanup(func() { d2.c.Remove(ctx, a.ID); d2.c.Remove(ctx, b.ID) })
	for _, id := range []string{a.ID, b.ID} {
		sb, err := d2.c.Get(ctx, id)
		if err != nil || sb.State != client.StateRunning {
			t.Fatalf("sandbox %s after the crash: %v %+v", id, err, sb)
		}
	}
	tree, err := d2.c.Tree(ctx, a.ID)
	if err != nil {
		t.Fatal(err)
	}
	if len(tree.Checkpoints) != 1 || tree.Checkpoints[0].ID != c1.ID || tree.Head != c1.ID {
		t.Fatalf("tree after the crash lists a half checkpoint: %+v", tree)
	}
	for _, pat := range []string{"pool/staging/" + a.ID + "-*", "images/staging-" + a.ID + "-*"} {
		if m, _ := filepath.Glob(filepath.Join(testenv.DataDir(), pat)); len(m) > 0 {
			t.Fatalf("leftovers of the dead checkpoint: %v", m)
		}
	}
	ents, _ := os.ReadDir(filepath.Join(testenv.DataDir(), "images"))
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), "staging-"+a.ID) {
			t.Fatalf("staged images left: %s", e.Name())
		}
	}
	// The frozen sandbox was thawed and its REPLs kept their state.
	if v := replValue(t, d2.c, a.ID, ha, "x"); v != "41" {
		t.Fatalf("x after the crash = %s", v)
	}
	if v := replValue(t, d2.c, b.ID, hb, "y"); v != "b" {
		t.Fatalf("y after the crash = %s", v)
	}
	c2, err := d2.c.Checkpoint(ctx, a.ID, client.CheckpointRequest{Label: "after-crash"})
	if err != nil {
		t.Fatal(err)
	}
	send(t, d2.c, a.ID, ha, "x = 0")
	if _, err := d2.c.Rollback(ctx, a.ID, c2.ID); err != nil {
		t.Fatal(err)
	}
	if v := replValue(t, d2.c, a.ID, ha, "x"); v != "41" {
		t.Fatalf("x after rollback = %s", v)
	}
}
