package dirty

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Mapping is one line of /proc/<pid>/maps.
type Mapping struct {
	Range
	Perms  string // "rw-p"
	Offset uint64 // in the file
	Dev    string // "MAJ:MIN" of the file
	Inode  uint64 // of the file; 0 for anonymous memory
	Path   string // the file, "[heap]", "[stack]", ... or "" for anonymous memory
}

// vma is the package's name for a mapping.
type vma = Mapping

// WritablePrivate says whether a write to the mapping changes memory of the process
// alone: what a rewind must put back, and what the tracker watches. [vsyscall] is the
// kernel's, and no userfaultfd can register it.
func (v Mapping) WritablePrivate() bool {
	return len(v.Perms) == 4 && v.Perms[1] == 'w' && v.Perms[3] == 'p' && v.Path != "[vsyscall]"
}

func (v Mapping) writablePrivate() bool { return v.WritablePrivate() }

// readMaps reads and parses /proc/<pid>/maps.
func readMaps(pid int) ([]vma, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/maps")
	if err != nil {
		return nil, fmt.Errorf("read the mappings of process %d: %w", pid, err)
	}
	ms, err := ParseMaps(b)
	if err != nil {
		return nil, fmt.Errorf("mappings of process %d: %w", pid, err)
	}
	return ms, nil
}

// ParseMaps parses the content of a maps file.
func ParseMaps(b []byte) ([]Mapping, error) {
	var out []Mapping
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
		off, err3 := strconv.ParseUint(f[2], 16, 64)
		ino, err4 := strconv.ParseUint(f[4], 10, 64)
		if err := errors.Join(err1, err2, err3, err4); err != nil {
			return nil, fmt.Errorf("line %q: %w", line, err)
		}
		v := Mapping{Range: Range{s, e}, Perms: f[1], Offset: off, Dev: f[3], Inode: ino}
		if len(f) > 5 {
			v.Path = strings.Join(f[5:], " ")
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
		if v.Inode != 0 {
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
		name := v.Path
		if name == "" {
			name = "anonymous"
		}
		parts = append(parts, fmt.Sprintf("%s %s %s", v.Range, v.Perms, name))
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
