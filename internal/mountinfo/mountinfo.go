// Package mountinfo reads /proc/<pid>/mountinfo (proc(5)).
package mountinfo

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Mount is one line of a mountinfo file.
type Mount struct {
	// ID is the mount's ID (the first field).
	ID int
	// Root is the root of the mount within its filesystem, MountPoint where it is
	// mounted, as the reading process sees them; both unescaped.
	Root, MountPoint string
	// FSType and Source are the fields after the separator.
	FSType, Source string
	// SuperOptions are the filesystem's options (the last field), split at commas.
	SuperOptions []string
}

// Read returns the mounts pid sees (0: the calling process), in mount order: of two
// mounts at one point, the later one is in effect.
func Read(pid int) ([]Mount, error) {
	name := "/proc/self/mountinfo"
	if pid != 0 {
		name = "/proc/" + strconv.Itoa(pid) + "/mountinfo"
	}
	b, err := os.ReadFile(name)
	if err != nil {
		return nil, err
	}
	return Parse(string(b))
}

// Parse parses the text of a mountinfo file.
func Parse(text string) ([]Mount, error) {
	var out []Mount
	for _, l := range strings.Split(text, "\n") {
		if strings.TrimSpace(l) == "" {
			continue
		}
		// "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue"
		pre, post, ok := strings.Cut(l, " - ")
		fl, pf := strings.Fields(pre), strings.Fields(post)
		if !ok || len(fl) < 5 || len(pf) < 2 {
			return nil, fmt.Errorf("malformed mountinfo line %q", l)
		}
		id, err := strconv.Atoi(fl[0])
		if err != nil {
			return nil, fmt.Errorf("malformed mountinfo line %q", l)
		}
		m := Mount{ID: id, Root: Unescape(fl[3]), MountPoint: Unescape(fl[4]), FSType: pf[0], Source: Unescape(pf[1])}
		if len(pf) > 2 {
			m.SuperOptions = strings.Split(pf[2], ",")
		}
		out = append(out, m)
	}
	return out, nil
}

// Unescape undoes the octal escapes of mountinfo's paths (\040 for a space, \134 for a
// backslash...).
func Unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
