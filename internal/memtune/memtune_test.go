package memtune

import (
	"fmt"
	"os"
	"os/exec"
	"runtime/debug"
	"strings"
	"testing"
)

// The child reports the collector's settings after Apply.
func TestMain(m *testing.M) {
	if os.Getenv("MEMTUNE_CHILD") == "1" {
		Apply()
		gc := debug.SetGCPercent(100)
		limit := debug.SetMemoryLimit(-1)
		fmt.Printf("%d %d\n", gc, limit)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func TestApply(t *testing.T) {
	for _, tt := range []struct {
		env  []string
		want string
	}{
		{nil, fmt.Sprintf("%d %d", Percent, Limit())},
		{[]string{"GOGC=50"}, fmt.Sprintf("50 %d", Limit())},
		{[]string{"GOMEMLIMIT=100MiB"}, fmt.Sprintf("%d %d", Percent, 100<<20)},
		{[]string{"GOGC=off", "GOMEMLIMIT=200MiB"}, fmt.Sprintf("-1 %d", 200<<20)},
	} {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(clean(os.Environ()), "MEMTUNE_CHILD=1")
		cmd.Env = append(cmd.Env, tt.env...)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("%v: %v", tt.env, err)
		}
		if got := strings.TrimSpace(string(out)); got != tt.want {
			t.Errorf("environment %v: GOGC and memory limit %s, want %s", tt.env, got, tt.want)
		}
	}
	if l := Limit(); l <= 0 || l > maxLimit {
		t.Errorf("Limit() = %d, want within (0, %d]", l, maxLimit)
	}
}

// clean drops GOGC and GOMEMLIMIT from env.
func clean(env []string) []string {
	var out []string
	for _, e := range env {
		if !strings.HasPrefix(e, "GOGC=") && !strings.HasPrefix(e, "GOMEMLIMIT=") {
			out = append(out, e)
		}
	}
	return out
}
