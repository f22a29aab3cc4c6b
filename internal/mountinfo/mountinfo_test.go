package mountinfo

import (
	"os"
	"slices"
	"testing"
)

func TestParse(t *testing.T) {
	ms, err := Parse("36 35 0:31 / /var/lib/cairn/pool rw,noatime shared:1 - btrfs /dev/loop0 rw,space_cache=v2,subvolid=5,subvol=/\n" +
		"37 22 0:32 /a\\040b /mnt/with\\040space rw - tmpfs tmp\\134x rw\n")
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) != 2 {
		t.Fatalf("%d mounts, want 2", len(ms))
	}
	if m := ms[0]; m.ID != 36 || m.MountPoint != "/var/lib/cairn/pool" || m.FSType != "btrfs" || m.Source != "/dev/loop0" ||
		!slices.Equal(m.SuperOptions, []string{"rw", "space_cache=v2", "subvolid=5", "subvol=/"}) {
		t.Errorf("first mount: %+v", m)
	}
	if m := ms[1]; m.Root != "/a b" || m.MountPoint != "/mnt/with space" || m.Source != `tmp\x` {
		t.Errorf("escapes: %+v", m)
	}
	for _, bad := range []string{"36 35 0:31 / /x rw shared:1 btrfs /dev/loop0 rw", "x 35 0:31 / /x rw - btrfs /dev/loop0 rw"} {
		if _, err := Parse(bad); err == nil {
			t.Errorf("Parse(%q) accepted a malformed line", bad)
		}
	}
}

func TestReadSelf(t *testing.T) {
	ms, err := Read(0)
	if err != nil {
		t.Fatal(err)
	}
	mine, err := Read(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(ms, func(m Mount) bool { return m.MountPoint == "/" }) || len(mine) != len(ms) {
		t.Errorf("mounts of self: %d, of pid %d: %d, root among them: %v", len(ms), os.Getpid(), len(mine),
			slices.ContainsFunc(ms, func(m Mount) bool { return m.MountPoint == "/" }))
	}
}
