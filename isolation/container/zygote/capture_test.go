package zygote

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/cairn-sandbox/cairn/internal/ptrace"
	"github.com/cairn-sandbox/cairn/isolation"
)

// TestCaptureRetriesEnding: a process listed, then gone before the capture stops it (a
// shell and its child killed together, conformance ResidentPaths), is not a reason to
// give up the zygotes: the capture is tried again and does not see it.
func TestCaptureRetriesEnding(t *testing.T) {
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil { // exited and reaped: its PID is gone
		t.Fatal(err)
	}
	gone := cmd.Process.Pid
	self, err := isolation.ProcOf(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	calls := 0
	tr := ptrace.NewTracer()
	defer tr.Close()
	dir := t.TempDir()
	rec, err := Capture(context.Background(), tr, CaptureOptions{
		Init: self,
		Procs: func() ([]int, error) {
			calls++
			if calls == 1 {
				return []int{gone}, nil
			}
			return nil, nil
		},
		CgroupDir: filepath.Join(dir, "cgroups"),
		RecordDir: dir,
	})
	if err != nil {
		t.Fatalf("Capture: %v (after %d listings)", err, calls)
	}
	if calls < 2 || len(rec.Procs) != 0 {
		t.Fatalf("Capture listed the processes %d times and recorded %d, want a second listing and none", calls, len(rec.Procs))
	}
}
