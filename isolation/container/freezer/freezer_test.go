package freezer

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"
)

// TestFreezeAndThaw freezes a real process in a freezer cgroup of its own and thaws it.
func TestFreezeAndThaw(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (cgroups)")
	}
	root := "/sys/fs/cgroup/freezer"
	if _, err := os.Stat(filepath.Join(root, "cgroup.procs")); err != nil {
		t.Fatalf("no cgroup v1 freezer hierarchy at %s: %v", root, err)
	}
	dir := filepath.Join(root, "cairn-freezer-test-"+strconv.Itoa(os.Getpid()))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		Write(dir, Thawed)
		cmd.Wait()
		for i := 0; i < 100 && os.Remove(dir) != nil; i++ {
			time.Sleep(10 * time.Millisecond)
		}
	})
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(cmd.Process.Pid)), 0); err != nil {
		t.Fatal(err)
	}
	if got := Procs(dir); !slices.Equal(got, []int{cmd.Process.Pid}) {
		t.Fatalf("Procs = %v, want [%d]", got, cmd.Process.Pid)
	}
	if got := Tasks(dir); !slices.Equal(got, []int{cmd.Process.Pid}) {
		t.Fatalf("Tasks = %v, want [%d] (sleep has one thread)", got, cmd.Process.Pid)
	}
	if IsFrozen(dir) {
		t.Fatal("IsFrozen before Set(Frozen)")
	}
	if err := Set(dir, Frozen); err != nil {
		t.Fatal(err)
	}
	if !IsFrozen(dir) {
		t.Fatal("not frozen after Set(Frozen)")
	}
	if err := Set(dir, Thawed); err != nil {
		t.Fatal(err)
	}
	if IsFrozen(dir) {
		t.Fatal("still frozen after Set(Thawed)")
	}
	if err := Wait(dir, Thawed); err != nil {
		t.Fatal(err)
	}
	if err := Write(filepath.Join(dir, "missing"), Frozen); err == nil {
		t.Fatal("Write to a cgroup that does not exist succeeded")
	}
	if got := Procs(filepath.Join(dir, "missing")); got != nil {
		t.Fatalf("Procs of a missing cgroup = %v, want none", got)
	}
}
