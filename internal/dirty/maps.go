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

// ParseMaps parses the content of a maps file. It runs at every checkpoint and rewind,
// on each process and zygote (a Python REPL maps ~130 ranges), so it parses the bytes in
// place: ~0.6 µs a line with strings.Fields and strconv took 78 µs for 125 lines.
func ParseMaps(b []byte) ([]Mapping, error) {
	out := make([]Mapping, 0, bytes.Count(b, []byte{'\n'})+1)
	for len(b) > 0 {
		line := b
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			line, b = b[:i], b[i+1:]
		} else {
			b = nil
		}
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		m, err := parseMapping(line)
		if err != nil {
			return nil, fmt.Errorf("line %q: %w", line, err)
		}
		out = append(out, m)
	}
	return out, nil
}

// errMapsLine is a line of a maps file that does not parse.
var errMapsLine = errors.New("not a mapping: want START-END PERMS OFFSET DEV INODE [PATH]")

// parseMapping parses one line of a maps file. The path is the rest of the line after
// the inode's padding, spaces in it kept.
func parseMapping(l []byte) (Mapping, error) {
	var f [5][]byte
	for i := range f {
		l = bytes.TrimLeft(l, " ")
		j := bytes.IndexByte(l, ' ')
		if j < 0 {
			j = len(l)
		}
		if j == 0 {
			return Mapping{}, errMapsLine
		}
		f[i], l = l[:j], l[j:]
	}
	lo, hi, ok := bytes.Cut(f[0], []byte{'-'})
	start, ok1 := parseHex(lo)
	end, ok2 := parseHex(hi)
	off, ok3 := parseHex(f[2])
	ino, ok4 := parseDec(f[4])
	if !ok || !ok1 || !ok2 || !ok3 || !ok4 {
		return Mapping{}, errMapsLine
	}
	m := Mapping{Range: Range{start, end}, Perms: intern(f[1]), Offset: off, Dev: intern(f[3]), Inode: ino}
	if path := bytes.TrimLeft(l, " "); len(path) > 0 {
		m.Path = string(path)
	}
	return m, nil
}

// intern returns the common permissions and devices without allocating.
func intern(b []byte) string {
	switch string(b) {
	case "rw-p":
		return "rw-p"
	case "r--p":
		return "r--p"
	case "r-xp":
		return "r-xp"
	case "---p":
		return "---p"
	case "00:00":
		return "00:00"
	}
	return string(b)
}

// parseHex parses a hexadecimal number of at most 16 digits.
func parseHex(b []byte) (uint64, bool) {
	if len(b) == 0 || len(b) > 16 {
		return 0, false
	}
	var v uint64
	for _, c := range b {
		switch {
		case '0' <= c && c <= '9':
			v = v<<4 | uint64(c-'0')
		case 'a' <= c && c <= 'f':
			v = v<<4 | uint64(c-'a'+10)
		default:
			return 0, false
		}
	}
	return v, true
}

// parseDec parses a decimal number (an inode: 64 bits).
func parseDec(b []byte) (uint64, bool) {
	if len(b) == 0 {
		return 0, false
	}
	if len(b) > 18 { // may not fit in the loop's arithmetic
		v, err := strconv.ParseUint(string(b), 10, 64)
		return v, err == nil
	}
	var v uint64
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		v = v*10 + uint64(c-'0')
	}
	return v, true
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
