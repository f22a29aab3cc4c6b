package container

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/cairn-sandbox/cairn/isolation"
)

// cgroupRoot is where the v1 controllers are mounted on this machine kind (hybrid mode).
var cgroupRoot = "/sys/fs/cgroup"

// controllers a sandbox gets a cgroup in. The freezer stops the tree for a checkpoint.
var controllers = []string{"memory", "pids", "cpu", "freezer"}

// cgroupPath is the cgroup of a sandbox, relative to every controller's root.
func cgroupPath(id string) string { return "/cairn/" + id }

func ctrlDir(ctrl, id string) string {
	return filepath.Join(cgroupRoot, ctrl, cgroupPath(id))
}

// createCgroups makes the sandbox's cgroups and writes its limits.
func createCgroups(id string, l isolation.Limits) error {
	for _, c := range controllers {
		if err := os.MkdirAll(ctrlDir(c, id), 0o755); err != nil {
			return fmt.Errorf("cgroup %s: %w (are the v1 controllers mounted under %s?)", c, err, cgroupRoot)
		}
	}
	mem := l.MemoryBytes
	if mem <= 0 {
		mem = 2 << 30
	}
	pids := l.Pids
	if pids <= 0 {
		pids = 1024
	}
	cpus := l.CPUs
	if cpus <= 0 {
		cpus = 2
	}
	writes := []struct{ ctrl, file, val string }{
		{"memory", "memory.limit_in_bytes", strconv.FormatInt(mem, 10)},
		{"pids", "pids.max", strconv.FormatInt(pids, 10)},
		{"cpu", "cpu.cfs_period_us", "100000"},
		{"cpu", "cpu.cfs_quota_us", strconv.FormatInt(int64(cpus*100000), 10)},
	}
	for _, w := range writes {
		if err := os.WriteFile(filepath.Join(ctrlDir(w.ctrl, id), w.file), []byte(w.val), 0); err != nil {
			return fmt.Errorf("cgroup %s/%s: %w", w.ctrl, w.file, err)
		}
	}
	return nil
}

func joinCgroups(id string, pid int) error {
	for _, c := range controllers {
		if err := os.WriteFile(filepath.Join(ctrlDir(c, id), "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
			return fmt.Errorf("join cgroup %s: %w", c, err)
		}
	}
	return nil
}

// cgroupPids lists the processes in the sandbox's freezer cgroup.
func cgroupPids(id string) []int {
	b, _ := os.ReadFile(filepath.Join(ctrlDir("freezer", id), "cgroup.procs"))
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if p, err := strconv.Atoi(f); err == nil {
			pids = append(pids, p)
		}
	}
	return pids
}

// removeCgroups deletes the sandbox's cgroups; they must be empty.
func removeCgroups(id string) error {
	var errs []error
	for _, c := range controllers {
		d := ctrlDir(c, id)
		for i := 0; i < 100; i++ {
			err := os.Remove(d)
			if err == nil || errors.Is(err, os.ErrNotExist) {
				break
			}
			if i == 99 {
				errs = append(errs, fmt.Errorf("remove cgroup %s: %w", d, err))
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	return errors.Join(errs...)
}

// freeze stops every task of the sandbox and waits until the freezer reports FROZEN.
func freeze(id string) error { return setFreezer(id, "FROZEN") }

func thaw(id string) error { return setFreezer(id, "THAWED") }

func setFreezer(id, state string) error {
	f := filepath.Join(ctrlDir("freezer", id), "freezer.state")
	if err := os.WriteFile(f, []byte(state), 0); err != nil {
		return fmt.Errorf("freezer: %w", err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for delay := 50 * time.Microsecond; ; delay *= 2 {
		b, err := os.ReadFile(f)
		if err != nil {
			return fmt.Errorf("freezer: %w", err)
		}
		if strings.TrimSpace(string(b)) == state {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("freezer: sandbox %s did not reach %s in 10s", id, state)
		}
		if state == "FROZEN" {
			// A task in an uninterruptible sleep can stall FREEZING; writing again retries.
			os.WriteFile(f, []byte(state), 0)
		}
		time.Sleep(min(delay, 2*time.Millisecond))
	}
}
