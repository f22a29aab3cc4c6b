package dirty

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// vma is one line of /proc/<pid>/maps.
type vma struct {
	Range
	perms string
	ino   uint64
	path  string
}

// writablePrivate says whether a write to the mapping changes memory of the process
// alone: what a rewind must put back, and what the tracker watches. [vsyscall] is the
// kernel's, and no userfaultfd can register it.
func (v vma) writablePrivate() bool {
	return len(v.perms) == 4 && v.perms[1] == 'w' && v.perms[3] == 'p' && v.path != "[vsyscall]"
}

// readMaps parses /proc/<pid>/maps, in one read (a stopped process's maps do not change
// between the reads of a longer file, but one read is also what the kernel serves
// fastest).
func readMaps(pid int) ([]vma, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/maps")
	if err != nil {
		return nil, fmt.Errorf("read the mappings of process %d: %w", pid, err)
	}
	var out []vma
	for len(b) > 0 {
		line := b
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			line, b = b[:i], b[i+1:]
		} else {
			b = nil
		}
		f := strings.Fields(string(line))
		if len(f) < 5 {
			continue
		}
		lo, hi, _ := strings.Cut(f[0], "-")
		s, err1 := strconv.ParseUint(lo, 16, 64)
		e, err2 := strconv.ParseUint(hi, 16, 64)
		ino, err3 := strconv.ParseUint(f[4], 10, 64)
		if err := errors.Join(err1, err2, err3); err != nil {
			return nil, fmt.Errorf("mappings of process %d: line %q: %w", pid, line, err)
		}
		v := vma{Range: Range{s, e}, perms: f[1], ino: ino}
		if len(f) > 5 {
			v.path = strings.Join(f[5:], " ")
		}
		out = append(out, v)
	}
	return out, nil
}

// areasOf returns the writable private memory of a process's mappings (adjacent
// mappings merged: one register, one scan each), and the part of it that maps a file
// (which needs the extra look of privateCopies).
func areasOf(vmas []vma) (areas, files Set) {
	for _, v := range vmas {
		if !v.writablePrivate() {
			continue
		}
		areas = append(areas, v.Range)
		if v.ino != 0 {
			files = append(files, v.Range)
		}
	}
	return normalise(areas), normalise(files)
}

// describe names the mappings of r, for errors.
func describe(vmas []vma, r Range) string {
	var parts []string
	for _, v := range vmas {
		if v.End <= r.Start || v.Start >= r.End {
			continue
		}
		name := v.path
		if name == "" {
			name = "anonymous"
		}
		parts = append(parts, fmt.Sprintf("%s %s %s", v.Range, v.perms, name))
	}
	if len(parts) > 4 {
		parts = append(parts[:4], fmt.Sprintf("and %d more", len(parts)-4))
	}
	return strings.Join(parts, ", ")
}

// vmFlags returns the VmFlags of smaps for the mappings of pid overlapping r (for
// errors: smaps is slow to read, it counts every page).
func vmFlags(pid int, r Range) []string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/smaps")
	if err != nil {
		return nil
	}
	var out []string
	in := false
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) == 0 {
			continue
		}
		if lo, hi, ok := strings.Cut(f[0], "-"); ok && !strings.HasSuffix(f[0], ":") {
			s, err1 := strconv.ParseUint(lo, 16, 64)
			e, err2 := strconv.ParseUint(hi, 16, 64)
			in = err1 == nil && err2 == nil && s < r.End && r.Start < e
			continue
		}
		if in && f[0] == "VmFlags:" {
			out = append(out, f[1:]...)
		}
	}
	return out
}
