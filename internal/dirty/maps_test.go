package dirty

import (
	"os"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// TestParseMaps parses lines of every shape a maps file has: anonymous memory, a named
// kernel area, a file, a path with spaces (kept as they are), a deleted file, an inode
// of 20 digits; and rejects lines that are not mappings.
func TestParseMaps(t *testing.T) {
	in := "55d0c6a00000-55d0c6a21000 rw-p 00000000 00:00 0                          [heap]\n" +
		"7f1c2a000000-7f1c2a021000 ---p 00000000 00:00 0 \n" +
		"7f1c2b000000-7f1c2b1c8000 r-xp 00028000 fe:01 1311745                    /usr/lib/x86_64-linux-gnu/libc.so.6\n" +
		"7f1c2c000000-7f1c2c001000 rw-s 00001000 00:2f 12  /tmp/a  b/c (deleted)\n" +
		"7fffffffe000-7ffffffff000 r--p 00000000 103:02 18446744073709551615\n" +
		"ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]"
	want := []Mapping{
		{Range: Range{0x55d0c6a00000, 0x55d0c6a21000}, Perms: "rw-p", Dev: "00:00", Path: "[heap]"},
		{Range: Range{0x7f1c2a000000, 0x7f1c2a021000}, Perms: "---p", Dev: "00:00"},
		{Range: Range{0x7f1c2b000000, 0x7f1c2b1c8000}, Perms: "r-xp", Offset: 0x28000, Dev: "fe:01", Inode: 1311745, Path: "/usr/lib/x86_64-linux-gnu/libc.so.6"},
		{Range: Range{0x7f1c2c000000, 0x7f1c2c001000}, Perms: "rw-s", Offset: 0x1000, Dev: "00:2f", Inode: 12, Path: "/tmp/a  b/c (deleted)"},
		{Range: Range{0x7fffffffe000, 0x7ffffffff000}, Perms: "r--p", Dev: "103:02", Inode: 18446744073709551615},
		{Range: Range{0xffffffffff600000, 0xffffffffff601000}, Perms: "--xp", Dev: "00:00", Path: "[vsyscall]"},
	}
	got, err := ParseMaps([]byte(in))
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("ParseMaps (-want +got):\n%s", diff)
	}
	for _, bad := range []string{
		"55d0c6a00000 rw-p 00000000 00:00 0",            // no end
		"55d0c6a00000-55d0c6a21000 rw-p 00000000 00:00", // no inode
		"55d0c6a00000-55d0c6a2100g rw-p 00000000 00:00 0",
		"55d0c6a00000-55d0c6a21000 rw-p 00000000 00:00 1x",
		"1155d0c6a00000000-55d0c6a21000 rw-p 00000000 00:00 0", // 17 digits
	} {
		if _, err := ParseMaps([]byte(bad)); err == nil {
			t.Errorf("ParseMaps(%q) = nil error, want one", bad)
		}
	}
	// Our own maps: every line parses.
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	ms, err := ParseMaps(b)
	if err != nil || len(ms) < 10 {
		t.Fatalf("our own maps: %d mappings, %v", len(ms), err)
	}
}
