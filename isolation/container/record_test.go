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

// TestCacheRecord: a record cached from its staged directory, renamed into place right
// after (as a checkpoint's is), is found by readRecord without reading its file.
func TestCacheRecord(t *testing.T) {
	staged := filepath.Join(t.TempDir(), "staged")
	if err := os.Mkdir(staged, 0o700); err != nil {
		t.Fatal(err)
	}
	rec := &zygote.Record{Version: zygote.Version, Init: isolation.Proc{Pid: 300, StartTime: 9}}
	if err := rec.Write(staged); err != nil {
		t.Fatal(err)
	}
	var r residents
	done := r.cacheRecord(staged)
	published := filepath.Join(filepath.Dir(staged), "published")
	if err := os.Rename(staged, published); err != nil { // before the cache is filled
		t.Fatal(err)
	}
	<-done
	reads := recordReads.Load()
	got, ok, err := r.readRecord(published)
	if err != nil || !ok || got.Init.Pid != 300 {
		t.Fatalf("read after the rename: %+v, %v, %v; want Init.Pid 300", got, ok, err)
	}
	if n := recordReads.Load() - reads; n != 0 {
		t.Errorf("readRecord read the file %d times; want the record cached before the rename", n)
	}
	// No record: nothing cached, no error.
	<-r.cacheRecord(t.TempDir())
}
