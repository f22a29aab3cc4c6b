// Package freezertest gives tests a real process in a freezer cgroup of its own.
package freezertest

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// Sleeper creates the freezer cgroup dir (cgroup v1), starts `sleep 60` in it and
// returns it. At the end of the test the process is killed, the cgroup thawed and
// removed.
func Sleeper(t testing.TB, dir string) *exec.Cmd {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		os.WriteFile(filepath.Join(dir, "freezer.state"), []byte("THAWED"), 0)
		cmd.Wait()
		for i := 0; i < 100 && os.Remove(dir) != nil; i++ {
			time.Sleep(10 * time.Millisecond)
		}
	})
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(cmd.Process.Pid)), 0); err != nil {
		t.Fatal(err)
	}
	return cmd
}
