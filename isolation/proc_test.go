package isolation

import (
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
)

// TestStatFields reads the stat files of this process and of a child, alive and then a
// zombie, against os.ReadFile's reading of the same.
func TestStatFields(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	// A name with a space and a parenthesis: fields are found after the last ')'.
	cmd.Args[0] = "a (b) c"
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	pid := cmd.Process.Pid
	file := "/proc/" + strconv.Itoa(pid) + "/stat"
	got, err := StatFields(file)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	want := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("StatFields(%s) = %q, want %q", file, got, want)
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
