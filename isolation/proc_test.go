package isolation

import (
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestStatFields reads the stat files of this process and of a child, alive and then a
// zombie, against os.ReadFile's reading of the same.
func TestStatFields(t *testing.T) {
	// A name with spaces and parentheses (the command name is the executed path's last
	// element): fields are found after the last ')'.
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Fatal(err)
	}
	odd := filepath.Join(t.TempDir(), "a (b) c")
	if err := os.Symlink(sleep, odd); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(odd, "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	pid := cmd.Process.Pid
	file := "/proc/" + strconv.Itoa(pid) + "/stat"
	// Once the exec is done (the name is the new one), the fields that do not move
	// (parent, group, session, start time) must read as os.ReadFile reads them.
	var got, want []string
	for i := 0; ; i++ {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		s := string(b)
		if strings.Contains(s, "(a (b) c)") {
			want = strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
			break
		}
		if i == 1000 {
			t.Fatalf("the child did not exec: %s", s)
		}
		time.Sleep(time.Millisecond)
	}
	if got, err = StatFields(file); err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Fatalf("StatFields(%s) = %q, want %d fields as in %q", file, got, len(want), want)
	}
	for _, i := range []int{1, 2, 3, 19} {
		if got[i] != want[i] {
			t.Fatalf("StatFields(%s) field %d = %q, want %q (%q)", file, i, got[i], want[i], want)
		}
	}
	if len(got) < 20 || got[1] != strconv.Itoa(os.Getpid()) {
		t.Fatalf("fields %q: want the parent %d in field 1", got, os.Getpid())
	}
	p, err := ProcOf(pid)
	if err != nil || !p.Alive() || !ProcAlive(pid) {
		t.Fatalf("ProcOf(%d) = %+v, %v: want it alive", pid, p, err)
	}
	if (Proc{Pid: pid, StartTime: p.StartTime + 1}).Alive() {
		t.Fatal("a process of another start time is alive")
	}
	cmd.Process.Kill()
	// A zombie until waited for.
	for i := 0; ProcAlive(pid); i++ {
		if i == 1000 {
			t.Fatal("killed process still alive")
		}
		f, _ := StatFields(file)
		if len(f) > 0 && f[0] == "Z" {
			break
		}
	}
	if p.Alive() {
		t.Fatal("a zombie is alive")
	}
	cmd.Wait()
	if _, err := StatFields(file); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("StatFields of a reaped process: %v, want ErrNotExist", err)
	}
}
