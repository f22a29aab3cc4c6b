package conformance

import (
	"context"
	"testing"

	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/internal/testenv"
)

func TestSmoke(t *testing.T) {
	e := testenv.Engine(t)
	ctx := context.Background()
	sb, err := e.Create(ctx, model.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Remove(ctx, sb.ID)
	h, err := e.Exec(ctx, sb.ID, model.ExecOptions{Args: []string{"python3", "-c", "print(1)"}, NoStdin: true})
	if err != nil {
		t.Fatal(err)
	}
	st, err := e.Wait(ctx, sb.ID, h)
	t.Log(st, err)
	out, _, _ := e.Output(ctx, sb.ID, h, "stdout", 0)
	t.Logf("%q", out)
	ck, err := e.Checkpoint(ctx, sb.ID, enginepkgOpts("a"))
	if err != nil {
		t.Fatal(err)
	}
	t.Log(ck.DurationMS)
	if err := e.Rollback(ctx, sb.ID, ck.ID); err != nil {
		t.Fatal(err)
	}
	forks, err := e.Fork(ctx, ck.ID, 2)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range forks {
		e.Remove(ctx, f.ID)
	}
}
