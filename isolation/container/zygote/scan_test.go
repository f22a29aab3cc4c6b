package zygote

import (
	"bytes"
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/internal/mountinfo"
)

// TestReadProcWhole checks that readProc reads a seq_file to its end: a read returns at
// most one page of records, and a single read once missed the mappings after the first
// ~50 (a Python process has hundreds).
func TestReadProcWhole(t *testing.T) {
	// 300 mappings that cannot merge (every other one read-only): ~20 KiB of maps.
	for i := 0; i < 300; i++ {
		prot := unix.PROT_READ
		if i%2 == 0 {
			prot |= unix.PROT_WRITE
		}
		m, err := unix.Mmap(-1, 0, 4096, prot, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Munmap(m)
	}
	// The Go runtime maps memory of its own at any time: the file is read again
	// until it held still around readProc's read.
	for try := 0; ; try++ {
		before, err := os.ReadFile("/proc/self/maps")
		if err != nil {
			t.Fatal(err)
		}
		if len(before) < 3*4096 {
			t.Fatalf("maps holds only %d bytes: the test needs more than a page of them", len(before))
		}
		got, err := readProcBytes("/proc/self/maps")
		if err != nil {
			t.Fatal(err)
		}
		after, err := os.ReadFile("/proc/self/maps")
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(before, after) && try < 10 {
			continue
		}
		if !bytes.Equal(got, after) {
			t.Fatalf("readProc read %d bytes of maps, the whole file has %d", len(got), len(after))
		}
		return
	}
}

// TestReadProcGrows reads a /proc file larger than readProc's first buffer (64 KiB),
// twice: the second read gets the buffer the first grew.
func TestReadProcGrows(t *testing.T) {
	want, err := os.ReadFile("/proc/kallsyms")
	if err != nil {
		t.Fatal(err)
	}
	if len(want) < 64<<10 {
		t.Fatalf("/proc/kallsyms holds only %d bytes: the test needs more than 64 KiB", len(want))
	}
	for i := 0; i < 2; i++ {
		got, err := readProcBytes("/proc/kallsyms")
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("read %d: readProc read %d bytes of /proc/kallsyms, the whole file has %d", i, len(got), len(want))
		}
	}
}

// readProcBytes returns a copy of what readProc reads.
func readProcBytes(name string) (got []byte, err error) {
	err = readProc(name, func(b []byte) error {
		got = bytes.Clone(b)
		return nil
	})
	return got, err
}

// TestRootMount: the root's mount ID from statx is the one mountinfo gives the topmost
// mount on "/" (and fdinfo's mnt_id for a file opened there), the ID space scan compares
// descriptors' mounts in.
func TestRootMount(t *testing.T) {
	got, err := rootMount(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	ms, err := mountinfo.Read(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	want := -1
	for _, m := range ms {
		if m.MountPoint == "/" {
			want = m.ID // the last one is on top
		}
	}
	if got != want {
		t.Errorf("rootMount = %d, mountinfo's / is %d", got, want)
	}
	f, err := os.Open("/")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := readFdinfo(os.Getpid(), int(f.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	if fi.mnt != got {
		t.Errorf("fdinfo of / says mount %d, rootMount %d", fi.mnt, got)
	}
}
