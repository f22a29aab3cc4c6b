package container

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/cairn-sandbox/cairn/isolation"
	"github.com/cairn-sandbox/cairn/isolation/container/zygote"
)

// TestReadRecordCache checks that readRecord returns the record read before while its
// file is the same, in its directory renamed too, and reads again a record replaced
// (Write renames), or removed.
func TestReadRecordCache(t *testing.T) {
	dir := t.TempDir()
	var r residents
	if _, ok, err := r.readRecord(dir); ok || err != nil {
		t.Fatalf("no record: ok %v, %v; want none and no error", ok, err)
	}
	write := func(pid int) {
		rec := &zygote.Record{Version: zygote.Version, Init: isolation.Proc{Pid: pid, StartTime: 7}}
		if err := rec.Write(dir); err != nil {
			t.Fatal(err)
		}
	}
	write(100)
	a, ok, err := r.readRecord(dir)
	if err != nil || !ok || a.Init.Pid != 100 {
		t.Fatalf("first read: %+v, %v, %v", a, ok, err)
	}
	b, _, _ := r.readRecord(dir)
	if b != a {
		t.Fatal("the same file was read again instead of cached")
	}
	write(200)
	c, ok, err := r.readRecord(dir)
	if err != nil || !ok || c.Init.Pid != 200 {
		t.Fatalf("after the record was replaced: %+v, %v, %v; want Init.Pid 200", c, ok, err)
	}
	// The directory renamed (a checkpoint's, staged, then published): the same file,
	// read before.
	moved := filepath.Join(filepath.Dir(dir), "published")
	if err := os.Rename(dir, moved); err != nil {
		t.Fatal(err)
	}
	dir = moved
	if d, ok, err := r.readRecord(dir); err != nil || !ok || d != c {
		t.Fatalf("after the directory was renamed: %+v, %v, %v; want the record read before", d, ok, err)
	}
	if err := os.Remove(filepath.Join(dir, zygote.RecordFile)); err != nil {
		t.Fatal(err)
	}
	if rec, ok, err := r.readRecord(dir); ok || err != nil {
		t.Fatalf("after the record was removed: %+v, %v, %v; want none", rec, ok, err)
	}
}
