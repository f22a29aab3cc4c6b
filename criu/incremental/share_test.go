package incremental

import (
	"bytes"
	"context"
	cryptoRand "crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/storage/btrfs"
)

// btrfsDir mounts a fresh btrfs image for the test and returns a directory on it.
func btrfsDir(t *testing.T) string {
	t.Helper()
	tmp := t.TempDir()
	p, err := btrfs.Open(context.Background(), btrfs.Config{Dir: filepath.Join(tmp, "pool"), Image: filepath.Join(tmp, "pool.img"), Size: 2 << 30})
	if err != nil {
		t.Fatalf("btrfs pool: %v", err)
	}
	t.Cleanup(func() { p.Unmount() })
	dir := filepath.Join(tmp, "pool", "images")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	return dir
}

// pagesSums returns the SHA-256 of every pages file of dir, by name.
func pagesSums(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if !isPagesFile(e.Name()) {
			continue
		}
		f, err := os.Open(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		h := sha256.New()
		io.Copy(h, f)
		f.Close()
		out[e.Name()] = fmt.Sprintf("%x", h.Sum(nil))
	}
	return out
}

// used is the bytes in use on dir's filesystem once its transaction is committed.
func used(t *testing.T, dir string) int64 {
	t.Helper()
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Syncfs(fd); err != nil {
		t.Fatal(err)
	}
	var st unix.Statfs_t
	if err := unix.Fstatfs(fd, &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Blocks-st.Bfree) * st.Bsize
}

// TestShare dumps the tree three times on btrfs, shares each dump's pages with its
// parent's, and checks that the pages files read the same, that the filesystem holds
// about one dump plus the changes, and that each directory restores alone once its
// parents are deleted. On another filesystem Share refuses, changing nothing.
func TestShare(t *testing.T) {
	criuPath := needCRIU(t)
	base := btrfsDir(t)
	tr, d1, d2, d3, s2, s3 := threeDumps(t, criuPath, base)
	sums2, sums3 := pagesSums(t, d2), pagesSums(t, d3)
	// A copy of c3 on another filesystem, for the refusal at the end.
	other := t.TempDir()
	if out, err := exec.Command("cp", "-a", d3, filepath.Join(other, "c3")).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v: %s", err, out)
	}
	before := used(t, base)

	res, err := Share(d2, d1, ShareOptions{Compress: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Share(d3, d2, ShareOptions{}); err != nil {
		t.Fatal(err)
	}
	after := used(t, base)
	t.Logf("c2: %d tasks, %d pages shared, %d own; filesystem %d → %d bytes", res.Tasks, res.SharedPages, res.OwnPages, before, after)
	if res.Tasks != 2 || res.OwnPages*16 > res.SharedPages {
		t.Fatalf("c2: %d tasks rebuilt, %d pages shared, %d own; want 2 tasks, under 1/16 own", res.Tasks, res.SharedPages, res.OwnPages)
	}
	// Two of the three dumps' pages (2 × 2 × 64 MiB) are gone but for the changes.
	if freed := before - after; freed < 3*holdBytes {
		t.Fatalf("sharing freed %d bytes, want at least %d", freed, 3*holdBytes)
	}
	for dir, want := range map[string]map[string]string{d2: sums2, d3: sums3} {
		if got := pagesSums(t, dir); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("%s: pages files changed content: %v, want %v", dir, got, want)
		}
		if p, _ := Parent(dir); p != "" {
			t.Fatalf("%s has a parent link after Share", dir)
		}
		checkClean(t, dir)
	}
	// Standalone: the parents go, each restores from its own files.
	os.RemoveAll(d1)
	restore(t, criuPath, tr, d2, s2)
	os.RemoveAll(d2)
	restore(t, criuPath, tr, d3, s3)

	// Not on one btrfs: refused, nothing changed.
	o3 := filepath.Join(other, "c3")
	if _, err := Share(o3, d3, ShareOptions{}); !errors.Is(err, ErrNoReflink) {
		t.Fatalf("Share across filesystems: %v, want ErrNoReflink", err)
	}
	if got := pagesSums(t, o3); fmt.Sprint(got) != fmt.Sprint(sums3) {
		t.Fatalf("a refused Share changed the pages files")
	}
	checkClean(t, o3)
}

// TestShareCrash kills Share once its first pages file is rebuilt, before the rename:
// the directory sweeps clean, restores, and a second Share completes.
func TestShareCrash(t *testing.T) {
	criuPath := needCRIU(t)
	tr, d1, d2, s2 := twoDumps(t, criuPath, btrfsDir(t))
	crash(t, "share-pages", "share:"+d2+":"+d1)
	if l, err := Leftovers(d2); err != nil || len(l) == 0 || !strings.HasSuffix(l[0], tmpSuffix) {
		t.Fatalf("after the crash Leftovers says %v, %v; want the temporary pages file", l, err)
	}
	if err := Sweep(d2); err != nil {
		t.Fatal(err)
	}
	checkClean(t, d2)
	restore(t, criuPath, tr, d2, s2)
	res, err := Share(d2, d1, ShareOptions{})
	if err != nil || res.Tasks != 2 {
		t.Fatalf("Share after the crash: %+v, %v", res, err)
	}
	checkClean(t, d2)
	// Done: a third Share says what the second did, at once.
	if again, err := Share(d2, d1, ShareOptions{}); err != nil || again.Tasks != 0 || again.SharedPages != res.SharedPages || again.OwnPages != res.OwnPages {
		t.Fatalf("Share of a shared directory: %+v, %v; want %+v without work", again, err, res)
	}
	restore(t, criuPath, tr, d2, s2)
}

// TestPackCompresses writes a pages file's own pages as Share does, single pages between
// holes (where shared pages would be cloned): in place, btrfs cannot compress them; through
// a pack they end up compressed, also after random bytes (which btrfs does not
// compress, and which, in one range written back with the text, would keep it from
// compressing the text: one pack file for all fails here). The pages read back the
// same either way.
func TestPackCompresses(t *testing.T) {
	dir := btrfsDir(t)
	const pages = 512
	text := make([]byte, pages*pageSize)
	for i := range text {
		text[i] = "0123456789abcdef"[(i*7+i/pageSize)%16]
	}
	random := make([]byte, 128<<10)
	if _, err := io.ReadFull(cryptoRand.Reader, random); err != nil {
		t.Fatal(err)
	}
	write := func(name string, packed bool) (int64, []byte) {
		t.Helper()
		f, err := os.OpenFile(filepath.Join(dir, name), os.O_CREATE|os.O_RDWR, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		w := &pack{dir: dir, dst: f}
		defer w.close()
		if packed {
			if err := w.open(); err != nil {
				t.Fatal(err)
			}
		} else {
			unix.Fsetxattr(int(f.Fd()), "btrfs.compression", []byte("zstd"), 0)
		}
		before := used(t, dir)
		// Random bytes first, then every other page of text.
		want := make([]byte, (len(random)/pageSize+2*pages)*pageSize)
		copy(want, random)
		if err := w.writeAt(random, 0); err != nil {
			t.Fatal(err)
		}
		for i := range pages {
			off := int64(len(random) + 2*i*pageSize)
			page := text[i*pageSize : (i+1)*pageSize]
			copy(want[off:], page)
			if err := w.writeAt(page, off); err != nil {
				t.Fatal(err)
			}
		}
		if err := w.flush(); err != nil {
			t.Fatal(err)
		}
		if err := f.Truncate(int64(len(want))); err != nil {
			t.Fatal(err)
		}
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(f.Name())
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("%s: the pages read back differ from those written", name)
		}
		return used(t, dir) - before, got
	}
	inPlace, _ := write("in-place", false)
	packed, _ := write("packed", true)
	own := int64(len(random) + pages*pageSize)
	t.Logf("%d bytes of own pages (%d random): %d bytes on disk in place, %d packed", own, len(random), inPlace, packed)
	if inPlace < own {
		t.Fatalf("in place, %d bytes of single pages took %d on disk: compressed after all?", own, inPlace)
	}
	if packed > int64(len(random))+pages*pageSize/2 {
		t.Fatalf("packed, %d bytes of own pages took %d on disk; want the text compressed to under half", own, packed)
	}
}
