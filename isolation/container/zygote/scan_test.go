package zygote

import (
	"bytes"
	"os"
	"testing"

	"golang.org/x/sys/unix"
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
	got, err := readProc("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	want, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	if len(want) < 3*4096 {
		t.Fatalf("maps holds only %d bytes: the test needs more than a page of them", len(want))
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("readProc read %d bytes of maps, the whole file has %d", len(got), len(want))
	}
}
