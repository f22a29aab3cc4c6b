package zygote

import (
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
)

// TestHolderOf names the process holding a PID: what a spawn that could not get its PID
// reports.
func TestHolderOf(t *testing.T) {
	cmd := exec.Command("sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	got := holderOf(os.Getpid(), cmd.Process.Pid)
	if want := "held by process " + strconv.Itoa(cmd.Process.Pid) + " (sleep)"; !strings.HasPrefix(got, want) {
		t.Fatalf("holderOf = %q, want it to begin with %q", got, want)
	}
	if got := holderOf(os.Getpid(), 1<<30); !strings.Contains(got, "not found") {
		t.Fatalf("holderOf of a free PID = %q", got)
	}
}
