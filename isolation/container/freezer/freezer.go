// Package freezer reads and sets cgroup v1 freezer cgroups, each given by its directory:
// their state (THAWED, FREEZING, FROZEN) and the processes in them. The container
// backend freezes sandboxes and their background CRIU with it; package zygote keeps
// each frozen template process in a cgroup of its own.
package freezer

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// The states Set and Wait take.
const (
	Frozen = "FROZEN"
	Thawed = "THAWED"
)

// Root is the mount point of the freezer hierarchy.
const Root = "/sys/fs/cgroup/freezer"

// Of returns the freezer cgroup directory of process (or thread) pid, "" if it cannot be
// read.
func Of(pid int) string {
	b, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	for _, l := range strings.Split(string(b), "\n") {
		if _, rel, ok := strings.Cut(l, ":freezer:"); ok {
			return filepath.Join(Root, rel)
		}
	}
	return ""
}

// timeout bounds how long Set and Wait wait for a state.
const timeout = 10 * time.Second

// Write writes the cgroup's state without waiting for it (freezing takes a moment).
func Write(dir, state string) error {
	if err := os.WriteFile(filepath.Join(dir, "freezer.state"), []byte(state), 0); err != nil {
		return fmt.Errorf("freezer %s: %w", dir, err)
	}
	return nil
}

// Set writes the cgroup's state and waits until the cgroup reaches it. While freezing,
// it writes FROZEN again now and then: a task in an uninterruptible sleep can stall
// FREEZING, and writing again retries.
func Set(dir, state string) error {
	if err := Write(dir, state); err != nil {
		return err
	}
	return wait(dir, state, state == Frozen)
}

// Wait waits until the cgroup reaches state.
func Wait(dir, state string) error { return wait(dir, state, false) }

func wait(dir, state string, rewrite bool) error {
	f := filepath.Join(dir, "freezer.state")
	deadline := time.Now().Add(timeout)
	for delay := 20 * time.Microsecond; ; delay = min(2*delay, time.Millisecond) {
		b, err := os.ReadFile(f)
		if err != nil {
			return fmt.Errorf("freezer %s: %w", dir, err)
		}
		if strings.TrimSpace(string(b)) == state {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("freezer %s did not reach %s within %s", dir, state, timeout)
		}
		if rewrite {
			os.WriteFile(f, []byte(state), 0)
		}
		time.Sleep(delay)
	}
}

// IsFrozen reports whether the cgroup is FROZEN (false if its state cannot be read).
func IsFrozen(dir string) bool { return State(dir) == Frozen }

// State reads the cgroup's state: THAWED, FREEZING or FROZEN ("" if it cannot be read).
func State(dir string) string {
	b, _ := os.ReadFile(filepath.Join(dir, "freezer.state"))
	return strings.TrimSpace(string(b))
}

// Procs lists the processes in the cgroup (none if it cannot be read).
func Procs(dir string) []int { return pids(filepath.Join(dir, "cgroup.procs")) }

// Tasks lists every thread in the cgroup (none if it cannot be read).
func Tasks(dir string) []int { return pids(filepath.Join(dir, "tasks")) }

func pids(file string) []int {
	b, _ := os.ReadFile(file)
	var out []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			out = append(out, pid)
		}
	}
	return out
}
