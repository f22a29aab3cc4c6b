package container

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/cairn-sandbox/cairn/isolation"
	"github.com/cairn-sandbox/cairn/isolation/container/zygote"
)

// Memory held by zygotes. A zygote stays in its sandbox's memory cgroup (only its
// freezer cgroup differs), so the pages it alone still maps (the old versions of those
// the sandbox's processes wrote since its checkpoint) count against the sandbox's
// memory limit beside the processes' own.

// ResidentMemory implements isolation.Resident: the memory cgroup's anonymous pages
// (each page counted once, however many processes map it) minus those the sandbox's
// own processes map. Pages shared between two of its processes (a fork that did not
// exec) are subtracted once per process, so the figure errs low by those; it is never
// below 0.
func (b *Backend) ResidentMemory(sb *isolation.Sandbox) (int64, error) {
	total, err := b.MemoryBytes(sb)
	if err != nil {
		return 0, err
	}
	for _, pid := range cgroupPids(sb.CgroupName()) {
		n, err := kbFields(procFile(pid, "status"), "RssAnon")
		if err != nil {
			continue // exited meanwhile: its pages are gone from total too, or soon
		}
		total -= n
	}
	return max(total, 0), nil
}

// CheckpointMemory implements isolation.Resident: the pages mapped by one of dir's
// zygotes and by no other process (smaps_rollup's Private_Clean and Private_Dirty),
// which DropResident(dir) frees.
func (b *Backend) CheckpointMemory(dir string) (int64, error) {
	rec, ok, err := zygote.Read(dir)
	if err != nil || !ok {
		return 0, err
	}
	var total int64
	for _, p := range rec.Procs {
		if !p.Zygote.Alive() {
			continue
		}
		n, err := kbFields(procFile(p.Zygote.Pid, "smaps_rollup"), "Private_Clean", "Private_Dirty")
		if err != nil {
			return 0, err
		}
		total += n
	}
	return total, nil
}

func procFile(pid int, name string) string {
	return filepath.Join("/proc", strconv.Itoa(pid), name)
}

// kbFields reads the "Name:   123 kB" fields names of a /proc file in one read, and
// returns their sum in bytes.
func kbFields(path string, names ...string) (int64, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	var sum int64
	found := 0
	for _, l := range strings.Split(string(data), "\n") {
		k, v, ok := strings.Cut(l, ":")
		if !ok || !slices.Contains(names, k) {
			continue
		}
		f := strings.Fields(v)
		if len(f) == 0 {
			continue
		}
		kb, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("%s: %s %q: %w", path, k, v, err)
		}
		sum += kb << 10
		found++
	}
	if found != len(names) {
		return 0, fmt.Errorf("%s: %d of the fields %v", path, found, names)
	}
	return sum, nil
}
