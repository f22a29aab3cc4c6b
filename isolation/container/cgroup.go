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
	"github.com/cairn-sandbox/cairn/isolation/container/freezer"
)

// cgroupRoot is where the v1 controllers are mounted on this machine kind (hybrid mode).
var cgroupRoot = "/sys/fs/cgroup"

// hierarchy is a v1 cgroup hierarchy: its controller name, and the directory it is
// mounted on under cgroupRoot.
type hierarchy struct{ ctrl, dir string }

// hierarchies a sandbox gets a cgroup in: every v1 hierarchy of this machine kind, so
// that the sandbox's cgroup namespace is rooted at its own cgroup everywhere and nothing
// inside can see or reach the host's cgroups. memory, pids and cpu carry the limits; the
// freezer stops the tree for a checkpoint.
var hierarchies = []hierarchy{
	{"memory", "memory"}, {"pids", "pids"}, {"cpu", "cpu"}, {"cpuacct", "cpuacct"},
	{"cpuset", "cpuset"}, {"devices", "devices"}, {"freezer", "freezer"}, {"blkio", "blkio"},
	{"name=systemd", "systemd"},
}

// present returns the hierarchies mounted here.
func present() []hierarchy {
	var out []hierarchy
	for _, h := range hierarchies {
		if _, err := os.Stat(filepath.Join(cgroupRoot, h.dir, "cgroup.procs")); err == nil {
			out = append(out, h)
		}
	}
	return out
}

// procsFiles are the cgroup.procs files of a sandbox's cgroups: a process that writes
// its PID to each joins the sandbox (CRIU does, before it forks a restored tree).
func procsFiles(id string) []string {
	var out []string
	for _, h := range present() {
		out = append(out, filepath.Join(ctrlDir(h.dir, id), "cgroup.procs"))
	}
	return out
}

// cgroupPath is the cgroup of a sandbox, relative to every hierarchy's root.
func cgroupPath(id string) string { return "/cairn/" + id }

func ctrlDir(dir, id string) string {
	return filepath.Join(cgroupRoot, dir, cgroupPath(id))
}

// createCgroups makes the sandbox's cgroups and writes its limits.
func createCgroups(id string, l isolation.Limits) error {
	hs := present()
	for _, r := range []string{"memory", "pids", "cpu", "freezer"} {
		if _, err := os.Stat(filepath.Join(cgroupRoot, r)); err != nil {
			return fmt.Errorf("cgroup controller %s is not mounted under %s: cairn needs the v1 memory, pids, cpu and freezer controllers", r, cgroupRoot)
		}
	}
	for _, h := range hs {
		if h.dir == "cpuset" {
			if err := initCpuset(filepath.Join(cgroupRoot, "cpuset", "cairn")); err != nil {
				return err
			}
		}
		if err := os.MkdirAll(ctrlDir(h.dir, id), 0o755); err != nil {
			return fmt.Errorf("cgroup %s: %w", h.dir, err)
		}
		if h.dir == "cpuset" {
			if err := initCpuset(ctrlDir(h.dir, id)); err != nil {
				return err
			}
		}
	}
	mem := l.MemoryBytes
	if mem <= 0 {
		mem = isolation.DefaultMemoryBytes
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

// initCpuset creates a cpuset cgroup whose cpus and mems are its parent's: a new cpuset
// starts empty, and no task may join an empty one.
func initCpuset(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
		cur, _ := os.ReadFile(filepath.Join(dir, f))
		if strings.TrimSpace(string(cur)) != "" {
			continue
		}
		parent, err := os.ReadFile(filepath.Join(filepath.Dir(dir), f))
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, f), parent, 0); err != nil {
			return fmt.Errorf("cpuset %s: %w", f, err)
		}
	}
	return nil
}

func joinCgroups(id string, pid int) error {
	for _, h := range present() {
		if err := os.WriteFile(filepath.Join(ctrlDir(h.dir, id), "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
			return fmt.Errorf("join cgroup %s: %w", h.dir, err)
		}
	}
	return nil
}

// cgroupPids lists the processes in the sandbox's freezer cgroup.
func cgroupPids(id string) []int { return freezer.Procs(ctrlDir("freezer", id)) }

// cgroupTasks lists every thread in the sandbox's freezer cgroup.
func cgroupTasks(id string) []int { return freezer.Tasks(ctrlDir("freezer", id)) }

// removeCgroups deletes the sandbox's cgroups; they must be empty.
func removeCgroups(id string) error {
	var errs []error
	for _, h := range present() {
		d := ctrlDir(h.dir, id)
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
func freeze(id string) error { return freezer.Set(ctrlDir("freezer", id), freezer.Frozen) }

func thaw(id string) error { return freezer.Set(ctrlDir("freezer", id), freezer.Thawed) }

// MemoryBytes is the anonymous memory resident in the sandbox's memory cgroup
// (memory.stat total_rss): what its processes hold, without the page cache they read.
func (b *Backend) MemoryBytes(sb *isolation.Sandbox) (int64, error) {
	data, err := os.ReadFile(filepath.Join(ctrlDir("memory", sb.CgroupName()), "memory.stat"))
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(l, "total_rss "); ok {
			return strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, fmt.Errorf("memory cgroup of %s: no total_rss in memory.stat", sb.ID)
}

var _ isolation.MemoryReporter = (*Backend)(nil)
