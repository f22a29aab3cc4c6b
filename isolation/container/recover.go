package container

import (
	"bytes"
	"context"
	"os"
	"slices"
	"strconv"
	"time"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/isolation"
	"github.com/cairn-sandbox/cairn/isolation/container/freezer"
)

// recoverWait bounds how long Recover waits for the CRIU of a dead checkpoint.
const recoverWait = 30 * time.Second

// Recover implements the engine's Recoverer: it thaws a sandbox that a checkpoint which
// died between its freeze and its thaw left frozen.
//
// If the checkpoint died while CRIU was dumping the tree, that CRIU still holds the
// processes (ptrace; the freezer reads THAWED meanwhile, as CRIU thaws the cgroup once it
// has seized them) and ends its dump on its own once it finds its caller gone: it puts
// the freezer back the way it found it, frozen, then lets the processes go. A thaw
// before that would be undone and the sandbox would stay frozen for good. So Recover
// first waits until no task of the sandbox is traced from outside it (a debugger inside
// the sandbox is the sandbox's business) and every such tracer has exited, then thaws,
// until the state holds. A sandbox with nothing to undo costs a read of its tasks.
func (b *Backend) Recover(ctx context.Context, sb *isolation.Sandbox) error {
	cg := sb.CgroupName()
	dir := ctrlDir("freezer", cg)
	deadline := time.Now().Add(recoverWait)
	pause := func() error {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
			return nil
		}
	}
	stuck := func(pid int) error {
		return errdefs.Unavailable("sandbox %s stays frozen: process %d (the CRIU of a checkpoint that died) still holds it after %s; once it has exited, restart cairn, which thaws the sandbox", sb.ID, pid, recoverWait)
	}
	seen := map[int]bool{}
	for tracer := outsideTracer(cg); tracer != 0; tracer = outsideTracer(cg) {
		seen[tracer] = true
		if time.Now().After(deadline) {
			return stuck(tracer)
		}
		if err := pause(); err != nil {
			return err
		}
	}
	for pid := range seen {
		for alive(pid) {
			if time.Now().After(deadline) {
				return stuck(pid)
			}
			if err := pause(); err != nil {
				return err
			}
		}
	}
	if st := state(dir); st != freezer.Frozen && st != "FREEZING" {
		return nil // thawed, or no cgroup (a stopped sandbox)
	}
	for held := 0; held < 10; {
		if state(dir) == freezer.Thawed {
			held++
		} else {
			held = 0
			if err := thaw(cg); err != nil {
				return err
			}
		}
		if time.Now().After(deadline) {
			return stuck(0)
		}
		if err := pause(); err != nil {
			return err
		}
	}
	return nil
}

// state reads a freezer cgroup's state ("" if it cannot).
func state(dir string) string {
	b, _ := os.ReadFile(dir + "/freezer.state")
	return string(bytes.TrimSpace(b))
}

// field returns the value of a field of /proc/<pid>/status, or "".
func field(pid int, name string) string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return ""
	}
	_, rest, ok := bytes.Cut(b, []byte("\n"+name+":"))
	if !ok {
		return ""
	}
	line, _, _ := bytes.Cut(rest, []byte("\n"))
	return string(bytes.TrimSpace(line))
}

// outsideTracer returns the PID of a process outside the cgroup that traces a task of
// it, or 0.
func outsideTracer(cgroup string) int {
	tasks := cgroupTasks(cgroup)
	for _, tid := range tasks {
		if pid, _ := strconv.Atoi(field(tid, "TracerPid")); pid != 0 && !slices.Contains(tasks, pid) {
			return pid
		}
	}
	return 0
}

// alive reports whether pid runs (not gone, not a zombie).
func alive(pid int) bool {
	st := field(pid, "State")
	return st != "" && st[0] != 'Z'
}
