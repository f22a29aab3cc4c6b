package container

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

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
		n, err := statusBytes(pid, "RssAnon:")
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
		for _, field := range []string{"Private_Clean:", "Private_Dirty:"} {
			n, err := kbField(filepath.Join("/proc", strconv.Itoa(p.Zygote.Pid), "smaps_rollup"), field)
			if err != nil {
				return 0, err
			}
			total += n
		}
	}
	return total, nil
}

// statusBytes reads a "Name:   123 kB" field of /proc/<pid>/status.
func statusBytes(pid int, field string) (int64, error) {
	return kbField(filepath.Join("/proc", strconv.Itoa(pid), "status"), field)
}

// kbField reads a "Name:   123 kB" field of a /proc file, in bytes.
func kbField(path, field string) (int64, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		v, ok := bytes.CutPrefix(sc.Bytes(), []byte(field))
		if !ok {
			continue
		}
		f := bytes.Fields(v)
		if len(f) == 0 {
			break
		}
		kb, err := strconv.ParseInt(string(f[0]), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("%s: %s %q: %w", path, field, v, err)
		}
		return kb << 10, nil
	}
	return 0, fmt.Errorf("%s: no %s field", path, field)
}
