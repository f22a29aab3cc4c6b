package freezer

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"

	"github.com/cairn-sandbox/cairn/isolation/container/freezer/freezertest"
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
	cmd := freezertest.Sleeper(t, dir)
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
